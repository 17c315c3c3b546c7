"""In-process A/B of this tree against another (``report.py --ab-pairs BASE_TREE``): one process
per pair imports both trees' packages and times the same workload built from each, interleaved.
The base tree's packages and ``examples/*.py`` are copied under new names (``moe_base``, ...)
by :func:`rename_source` (NAME tokens, not attributes, comments or messages; and strings that
are whole dotted module paths of the copy). Neither tree registers primitives, lowerings, FFI
targets or JAX options; flax's Linen name ``balancing_bias``, which both register, goes back
to this tree's class. :func:`check_own_code` checks module origins.
Against 54b8671 (BASE/COMMIT names it): ``report.py --ab-pairs BASE --pairs muon_step --out
AB.json``, then ``report.py --adopt muon_step_1gpu RUN.json --keys-from AB.json``.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
import traceback
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from _lib import ROOT, bench
from xla_comm.breakdown import Rule, scope_regex

PACKAGES = ("moe", "muon_jax", "xla_comm", "accel_kernels")
ROUNDS = {"layer": 20, "experts": 20, "muon_step": 10, "lm_step": 10}  # the pairs' rounds
NS_RULES = (Rule("gemm", "scope", scope_regex(r"tiles_\d+_of_\d+")),  # see ns_passes
            Rule("gemm", "kernel", r"^symmetric_(?:upper|full)|^anonymous_mosaic_gpu_kernel"))
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:4.0f}s] {msg}", flush=True)


def rename_source(src: str, names: dict[str, str], modules: set[str]) -> tuple[str, int]:
    """``src`` with the NAME tokens in ``names`` renamed (not after a '.') and the strings that
    are a whole dotted path in ``modules`` (or an attribute of one); how many such strings."""
    lines, edits, n_str, prev = src.splitlines(keepends=True), [], 0, None
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        (row, col), text = tok.start, tok.string
        if tok.type == tokenize.NAME and text in names and prev != ".":
            edits.append((row, col, text, names[text]))
        elif tok.type == tokenize.STRING:
            if "f" in text[:2].lower() and any(isinstance(n, ast.Name) and n.id in names
                                               for n in ast.walk(ast.parse(text, mode="eval"))):
                raise ValueError(f"line {row}: an f-string names a renamed package: {text}")
            top = (value := text.strip("\"'")).split(".")[0]
            if top in names and text[0] in "\"'" and re.fullmatch(r"\w+(\.\w+)+", value) and (
                    value in modules or value.rsplit(".", 1)[0] in modules):
                edits.append((row, col + text.index(value), top, names[top]))
                n_str += 1
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = text
    for row, col, old, new in sorted(edits, reverse=True):
        line = lines[row - 1]
        assert line[col:col + len(old)] == old, (row, col, old)
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines), n_str


def load_base(tree: str | Path, with_examples: bool) -> SimpleNamespace:
    """``tree``'s packages (and ``examples/*.py``) copied renamed into a temporary folder on
    ``sys.path``, and imported (after this tree's: see :func:`new_tree`)."""
    tree, dest = Path(tree).resolve(), Path(tempfile.mkdtemp(prefix="ab_base_"))
    pkgs = [p for p in PACKAGES if (tree / p / "__init__.py").exists()]
    mods = sorted(p.stem for p in (tree / "examples").glob("*.py")) if with_examples else []
    names = {n: n + "_base" for n in pkgs + mods}
    for p in pkgs:
        shutil.copytree(tree / p, dest / names[p], ignore=shutil.ignore_patterns("__pycache__"))
    for m in mods:
        shutil.copy(tree / "examples" / f"{m}.py", dest / f"{names[m]}.py")
    modules = {".".join(f.relative_to(tree).with_suffix("").parts).removesuffix(".__init__")
               for p in pkgs for f in (tree / p).rglob("*.py")}
    strings = 0
    for f in dest.rglob("*.py"):
        text, n = rename_source(f.read_text(), names, modules)
        f.write_text(text)
        strings += n
    from flax.nnx import variablelib

    cache = dict(variablelib.VariableTypeCache)
    sys.path.append(str(dest))
    wanted = [p for p in pkgs if p != "xla_comm"] + ["train_lm"] * with_examples
    base = SimpleNamespace(dir=dest, names=names, strings_renamed=strings,
                           **{p: importlib.import_module(names[p]) for p in wanted})
    restored = [k for k, v in cache.items() if variablelib.VariableTypeCache.get(k) is not v]
    variablelib.VariableTypeCache.update({k: cache[k] for k in restored})
    base.restored = [f"flax variable name {k!r}" for k in restored]
    return base


def new_tree(with_examples: bool) -> SimpleNamespace:
    """This tree's packages (and ``examples/train_lm.py``)."""
    sys.path.insert(0, str(ROOT / "examples"))
    return SimpleNamespace(**{p: importlib.import_module(p) for p in (
        "moe", "muon_jax", "accel_kernels", "train_lm")[:3 + with_examples]})


def check_own_code(base: SimpleNamespace) -> list[str]:
    """The loaded modules of either tree whose file is not in that tree (none expected)."""
    homes = dict.fromkeys(base.names, ROOT) | dict.fromkeys(base.names.values(), base.dir)
    return [f"{name}: {m.__file__}" for name, m in list(sys.modules.items())
            if getattr(m, "__file__", None) and name.split(".")[0] in homes and not Path(
                m.__file__).resolve().is_relative_to(homes[name.split(".")[0]].resolve())]


def rel_err(got, want, ref=None) -> float:
    """The largest ``|got - want| / |want - ref|`` (2-norms; ``ref``: what both moved from)."""
    def one(g, w, r):
        w = w.astype(jnp.float32)
        return jnp.linalg.norm(g - w) / jnp.maximum(jnp.linalg.norm(w - r), 1e-30)

    refs = jax.tree.leaves(ref) if ref is not None else [0.0] * len(jax.tree.leaves(want))
    return max(float(jax.jit(one)(g, w, r)) for g, w, r in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), refs, strict=True))


def measure(case: str, sides: dict, a, *, tol: float, inner: int = 1, pick=lambda out: out,
            ref=None, check: dict | None = None) -> dict:
    """One case: each side's ``fn()`` (``sides``: {'new': fn, 'base': fn}; first ``check``'s,
    where given) run, the outputs (``pick`` of them) compared, then timed interleaved."""
    outs, first_s = {}, {}
    for side, fn in (check or sides).items():
        t0 = time.perf_counter()
        outs[side] = pick(jax.block_until_ready(fn()))
        first_s[side] = round(time.perf_counter() - t0, 2)
    err = rel_err(outs.pop("new"), outs.pop("base"), ref)  # and the outputs freed
    log(f"{case}: first calls {first_s} s; new vs base max rel err {err:.2e} (tol {tol:g})")
    times = bench.interleaved(sides, a.rounds, inner=inner, warmup=1)  # after the first runs
    ms = {k: v * 1e3 for k, v in bench.medians(times).items()}
    log(f"{case}: base {ms['base']:.3f} ms, new {ms['new']:.3f} ms, "
        f"new/base {ms['new'] / ms['base']:.4f}")
    return {"base_ms": ms["base"], "new_ms": ms["new"], "new_over_base": ms["new"] / ms["base"],
            "agreement": {"max_rel_err": err, "tol": tol, "ok": bool(err <= tol)},
            "first_call_s": first_s, "rounds": a.rounds, "inner": inner,
            "samples_ms": {k: [round(t * 1e3, 4) for t in v] for k, v in times.items()}}


def pair_layer(trees: dict, a) -> dict:
    """``moe.moe_apply`` forward + backward (gradients w.r.t. x, the router kernel, both banks)
    at benchmarks/layer.py's default shapes: one device, bf16, balanced routing (zero bias),
    dropless and dense (capacity 1.25) transports, the library's defaults otherwise."""
    tokens, d, f, e, k = (64, 128, 64, 16, 2) if a.small else (16384, 4096, 2048, 16, 2)
    mesh = bench.line_mesh(devices=jax.devices()[:1])
    data = bench.layer_data(mesh, tokens, d, e, f, a.seed)
    args = (*(data[n] for n in ("x", "router_kernel", "w_gate_up", "w_down")),
            jnp.zeros(e, jnp.float32), data["ct"])
    cases = {}
    for transport, cf in (("dropless", None), ("dense", 1.25)):
        def step(moe, t=transport, cf=cf):
            opts = moe.MoEOptions.create(e, k, expert_axis="expert", transport=t,
                                         capacity_factor=cf)
            return partial(bench.fwd_bwd(
                lambda *xs: moe.moe_apply(*xs, options=opts, mesh=mesh)[0], 4), *args)

        cases[transport] = measure(f"layer/{transport}", {s: step(t.moe) for s, t in
                                                          trees.items()}, a, tol=1e-2, inner=3)
    return {"shapes": dict(tokens=tokens, d_model=d, d_ff=f, experts=e, top_k=k), "cases": cases}


def pair_experts(trees: dict, a) -> dict:
    """``moe.gated_experts`` forward + backward (gradients w.r.t. x and both banks) at
    experts.py's default shapes: ragged balanced rows, backend 'auto' (Hopper: Mosaic, on
    128-aligned rows as experts.py lays them out), bf16 and all three GEMMs in FP8."""
    rows, d, f, e = (1024, 256, 128, 4) if a.small else (32768, 4096, 2048, 8)
    gmm, ks = trees["new"].accel_kernels.gmm.api, jax.random.split(jax.random.key(a.seed), 4)
    x, gs = bench.normal(ks[0], (rows, d)), jnp.asarray(bench.group_sizes("balanced", rows, e))
    align = gmm.GROUP_ALIGNMENT if gmm.auto_implementation(2) == "mosaic" else None
    if align:
        x = jnp.take(x, gmm.align_map(gs, rows, align)[0], axis=0, mode="fill", fill_value=0)
    args = (x, bench.normal(ks[1], (e, d, 2 * f), d**-0.5),
            bench.normal(ks[2], (e, f, d), f**-0.5), bench.normal(ks[3], x.shape))
    cases = {}
    for r in ("bf16", "fp8"):
        def step(moe, r=r):
            return partial(bench.fwd_bwd(lambda x, wgu, wd: moe.gated_experts(
                x, gs, wgu, wd, group_alignment=align, gemm_dtype=r, dgrad_dtype=r,
                wgrad_dtype=r), 3), *args)

        cases[r] = measure(f"experts/{r}", {s: step(t.moe) for s, t in trees.items()}, a,
                           tol=1e-2 if r == "bf16" else 3e-2, inner=3)
    return {"shapes": dict(rows=rows, d_model=d, d_ff=f, experts=e, group_alignment=align),
            "cases": cases}


def pair_muon_step(trees: dict, a) -> dict:
    """A ``muon_jax.muon`` step (update, apply) on muon_step.py's 1.62B bf16 params, sharded
    over a one-device mesh (unsharded, each matrix compiles kernels of its own: minutes on
    Hopper), library defaults (bf16 momentum: both trees' f32 states may not fit an H100); no
    MoE banks (the new tree splits them). Agreement: the param changes (bf16 rounding ~1e-3).
    Then :func:`ns_passes` (this tree) and :func:`polar_errors` (layer 0's gradients)."""
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    layers, d, f = (1, 64, 176) if a.small else (8, 4096, 11008)
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_gate": (d, f),
              "w_up": (d, f), "w_down": (f, d)}
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Explicit,))

    def tree(salt, scale):  # bf16 normals, a key per matrix
        return {f"layer_{i}": {k: (scale * jax.random.normal(jax.random.key(
            salt + 10 * i + j), s)).astype(jnp.bfloat16) for j, (k, s) in enumerate(
                shapes.items())} for i in range(layers)}

    put = NamedSharding(mesh, P())
    params, grads = (jax.jit(lambda s=s, c=c: tree(s, c), out_shardings=put)()
                     for s, c in ((1000, 0.02), (2000, 1.0)))

    def step(muon_jax):  # sharding=ShardingOptions(mesh); in 8b11414 mesh=mesh
        kw = ({"sharding": muon_jax.ShardingOptions(mesh)} if hasattr(
            muon_jax, "ShardingOptions") else {"mesh": mesh})
        tx = muon_jax.muon(0.02, weight_decay=0.01, **kw)
        state = tx.init(params)
        fn = jax.jit(lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(
            *tx.update(g, s, p)))
        return lambda: fn(params, state, grads)

    with jax.set_mesh(mesh):
        case = measure("muon_step", {s: step(t.muon_jax) for s, t in trees.items()}, a,
                       tol=2e-2, pick=lambda out: out[0], ref=params)
        ns = ns_passes(trees["new"].muon_jax, params, mesh)
    return {"shapes": dict(layers=layers, d_model=d, d_ff=f), "cases": {"update": case},
            "ns_profile": ns, "orthogonality": polar_errors(trees, {
                k: grads["layer_0"][k] for k in ("wq", "w_gate", "w_down")})}


def ns_passes(muon_jax, params, mesh) -> dict:
    """Newton-Schulz alone as muon_step.py's ``ns`` runs it (the tree's defaults on its owner
    stacks of ``params``, f32 in, bf16 out), 3 calls traced: ``ratio``, device time of the
    kernels that are not GEMMs over that of GEMMs (None, with the reason, where the profiler
    fails). Each kernel is classified by the HLO instruction it runs (``op_breakdown``): dots
    and fusions holding one, cuBLAS / cuBLASLt custom calls, and the symmetric-tile Mosaic GPU
    kernel, a custom call under its ``tiles_W_of_T`` scope (xla_comm.costs.TILES_SCOPE), are
    GEMMs; kernels that name no instruction are classified by name (Mosaic's by ours)."""
    plan = muon_jax.scale_by_muon(sharding=muon_jax.ShardingOptions(mesh)).init(params).plan
    xs = [jnp.ones((s.k_owner, s.m, s.n), jnp.float32) for s in plan.stacks]
    f = jax.jit(lambda xs: [muon_jax.orthogonalize(x).astype(jnp.bfloat16) for x in xs])
    prof = bench.trace_profile(f.lower(xs).compile(), (xs,), tempfile.mkdtemp(prefix="ns_"), 3,
                               rules=NS_RULES)
    bd = prof.get("breakdown", {})
    us = bd.get("us_per_step") or {}
    ratio = (sum(us.values()) - us["gemm"]) / us["gemm"] if us.get("gemm") else None
    log(f"muon_step: Newton-Schulz non-GEMM over GEMM device time {ratio}")
    return {"ratio": ratio, "shapes": [[s.k_owner, s.m, s.n] for s in plan.stacks]} | (
        {k: bd[k] for k in ("us_per_step", "top_ops", "unmatched_kernels")} if ratio
        is not None else {"reason": prof.get("reason", bd)})


def polar_errors(trees: dict, mats: dict) -> dict:
    """Each tree's ``orthogonalize`` with its defaults (what its Muon runs) of each matrix
    (f32): the relative Frobenius distance to the exact polar factor ``U V^T``, by QDWH
    (``jax.scipy.linalg.polar``, f32 matmuls: within 1e-6 of a float64 SVD's on 512 x 1376; an
    SVD of 4096 x 11008 takes minutes on a host); ``ratio``: the largest new / base."""
    xs = [jnp.asarray(np.asarray(x), jnp.float32) for x in mats.values()]  # off the mesh
    want = jax.jit(lambda xs: [jax.scipy.linalg.polar(x, ("right", "left")[  # QDWH: m >= n
        x.shape[0] < x.shape[1]])[0] for x in xs])(xs)
    err = {s: dict(zip(mats, map(float, jax.jit(lambda xs, ws, f=t.muon_jax.orthogonalize: [
        jnp.linalg.norm(f(x) - w) / jnp.linalg.norm(w) for x, w in zip(xs, ws, strict=True)])(
            xs, want)), strict=True)) for s, t in trees.items()}
    ratio = max(err["new"][k] / err["base"][k] for k in mats)
    log(f"muon_step: distance to the polar factor {err}, new / base at most {ratio:.4f}")
    return {"error": err, "ratio": ratio, "shapes": {k: list(x.shape) for k, x in mats.items()}}


def pair_lm_step(trees: dict, a) -> dict:
    """examples/train_lm.py's ``train_step`` (forward, backward of cross-entropy + balancing
    and router z-losses, update) on the model, optimizer and flags the trainer builds
    (``parse_args``, ``create``): GPU preset, AdamW (Muon's treatment of MoE banks changed),
    one device, random bytes. Agreement: the losses of two steps, the second after an update."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    argv = ["--optimizer", "adamw", "--preset", "gpu", *(
        "--batch 8 --seq-len 32 --d-model 128 --layers 2 --heads 4 --d-ff 128 --experts 8 "
        "--fp8-block-size 32".split() if a.small else [])]
    mesh, sides, check = bench.line_mesh(devices=jax.devices()[:1]), {}, {}
    args = trees["new"].train_lm.parse_args(argv)
    tokens = np.random.default_rng(a.seed).integers(0, 256, (args.batch, args.seq_len + 1))
    batch = jax.device_put(jnp.asarray(tokens, jnp.int32),
                           NamedSharding(mesh, P(("data", "expert"), None)))
    for side, t in trees.items():
        model, opt = t.train_lm.create("adamw", t.train_lm.parse_args(argv), mesh)
        sides[side] = lambda tl=t.train_lm, m=model, o=opt: tl.train_step(
            m, o, batch, args.aux_loss, args.z_loss)
        check[side] = lambda fn=sides[side]: [(m["loss"], m["load_balance_loss"])
                                              for m in (fn(), fn())]
    with jax.set_mesh(mesh):
        case = measure("lm_step", sides, a, tol=1e-2, check=check)
    return {"trainer_flags": argv, "cases": {"train_step": case}}


def worker(base_tree: str, name: str, rounds: int | None, small: bool, out: str) -> int:
    """``report.py --ab-pairs BASE --pairs NAME --ab-worker``: one pair, in this process."""
    if small:
        bench.simulate_cpu(1)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # Muon: two states
    a = SimpleNamespace(small=small, seed=0, rounds=rounds or (3 if small else ROUNDS[name]))
    try:
        log(f"{name}: loading this tree and {base_tree}")
        trees = {"new": new_tree(name == "lm_step")}  # first: see load_base
        trees["base"] = base = load_base(base_tree, name == "lm_step")
        log(f"{name}: base copy in {base.dir}, restored: {base.restored or 'nothing'}")
        rec = globals()[f"pair_{name}"](trees, a)
    except Exception:  # noqa: BLE001  (report.py would print one line; the lead needs it all)
        traceback.print_exc()
        return 1
    ratios = [c["new_over_base"] for c in rec["cases"].values()]
    rec.update(pair=name, env=bench.env(), loader={
        "dir": str(base.dir), "renamed": base.names, "strings_renamed": base.strings_renamed,
        "restored": base.restored, "foreign_modules": check_own_code(base)},
        new_over_base=math.exp(sum(map(math.log, ratios)) / len(ratios)))
    bench.write_json(out, rec)
    shutil.rmtree(base.dir, ignore_errors=True)
    return 0


def run_all(base_tree: str, pairs: list[str], rounds: int | None, small: bool, out: str,
            timeout: int) -> int:
    """Each pair in a process of its own (this one never starts JAX's backend), then one JSON
    and a table; exit 1 unless every pair ran and agreed."""
    if bad := set(pairs) - set(ROUNDS):
        raise ValueError(f"unknown pairs {sorted(bad)}; choose from {','.join(ROUNDS)}")
    tmp, base_tree = Path(tempfile.mkdtemp(prefix="ab_pairs_")), Path(base_tree).resolve()
    rep = {"benchmark": "ab_pairs", "commit": bench.commit(), "base_commit": bench.commit(
        base_tree), "base_tree": str(base_tree), "small": small, "pairs": {}, "errors": {}}
    for name in pairs:
        path, t0 = tmp / f"{name}.json", time.perf_counter()
        argv = [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--ab-pairs",
                str(base_tree), "--pairs", name, "--ab-worker", "--out", str(path),
                *(["--small"] if small else []), *(["--rounds", str(rounds)] if rounds else [])]
        try:
            rc = subprocess.run(argv, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout} s"
        if path.exists():
            rep["pairs"][name] = json.loads(path.read_text()) | {
                "wall_s": round(time.perf_counter() - t0, 1)}
        else:
            rep["errors"][name] = f"exit {rc}"
        log(f"{name}: exit {rc} in {time.perf_counter() - t0:.0f} s")
        rep = summarize(rep, pairs)
        bench.write_json(out, rep)
    bench.print_table([{"pair": n, "case": c, "base_ms": r["base_ms"], "new_ms": r["new_ms"],
                        "new/base": r["new_over_base"], "rel_err": r["agreement"]["max_rel_err"],
                        "agree": r["agreement"]["ok"]} for n, p in rep["pairs"].items()
                       for c, r in p["cases"].items()],
                      ["pair", "case", "base_ms", "new_ms", "new/base", "rel_err", "agree"])
    print(f"{rep['commit']} over {rep['base_commit']} on {rep['device']}: " + ", ".join(
        f"{k} {rep[k]}" for k in ("max_abs_log_ratio", "all_within_3pct", "all_agree",
                                  "complete", "errors")))
    return 0 if rep["complete"] and rep["all_agree"] else 1


def summarize(rep: dict, pairs: list[str]) -> dict:
    """The summary keys: the device, the largest |log(new / base)| of any case, whether every
    case is within 3% and agrees, whether every pair ran on its own trees' code; with the
    muon_step pair, ``update_over_BASE`` (its new / base; BASE the base commit, where known),
    ``orthogonality_error_ratio`` and ``ns_passes_over_gemm_time`` (:func:`pair_muon_step`)."""
    cases = [c for p in rep["pairs"].values() for c in p["cases"].values()]
    rep["device"] = next((p["env"]["device_kind"] for p in rep["pairs"].values()), None)
    if ms := rep["pairs"].get("muon_step"):
        base = rep["base_commit"] if rep["base_commit"] != "unknown" else "base"
        rep |= {f"update_over_{base}": ms["cases"]["update"]["new_over_base"],
                "orthogonality_error_ratio": ms["orthogonality"]["ratio"],
                "ns_passes_over_gemm_time": ms["ns_profile"]["ratio"]}
    ratios = [c["new_over_base"] for c in cases]
    return rep | {"max_abs_log_ratio": max((round(abs(math.log(r)), 5) for r in ratios),
                                           default=None),
                  "all_within_3pct": bool(cases) and all(abs(r - 1) <= 0.03 for r in ratios),
                  "all_agree": bool(cases) and all(c["agreement"]["ok"] for c in cases),
                  "complete": set(rep["pairs"]) == set(pairs) and not any(
                      p["loader"]["foreign_modules"] for p in rep["pairs"].values())}

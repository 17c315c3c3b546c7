"""Is the moe layer ahead of the MoE blocks a PyTorch user runs?

transformers' ``Qwen3MoeSparseMoeBlock`` and ``MixtralSparseMoeBlock`` with ``grouped_mm``
experts (tokens sorted by expert, ``torch._grouped_mm``), eager and under ``torch.compile``,
against ``moe.moe_apply`` on the same weights (through ``moe.convert.from_transformers``) and
inputs, bf16 and FP8 recipes, dropless and dense transport (at a capacity this routing drops
nothing at): forward + backward (the gradients of ``sum(y * ct)`` w.r.t. x, the router and both
banks) in one process on one GPU, against both frameworks' dense 8192^3 bf16 rates.

Before any timing, y, dx and the weight gradients are checked against the eager block's, the
cotangent zeroed on tokens whose top-k sets differ between the routers (ties: the block rounds
its logits to bf16, moe keeps f32; the fraction is reported). Then interleaved rounds, medians.

    python3 benchmarks/vs_transformers.py --out layer_vs_transformers.json   # one H100/H200
    python3 benchmarks/vs_transformers.py --shapes mixtral_8x7b --rounds 3
    python3 benchmarks/vs_transformers.py --small --moe-only     # CPU: the moe side alone

Without torch and transformers it says so and exits (``--moe-only`` needs neither). Shapes:
``SHAPES`` (``unaligned``: widths that are multiples of 16, not of 128; ``aligned``: the nearest
multiples of 128). JSON: ``rows``, ``checks``, ``ceilings`` and :func:`summarize`'s keys.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from _lib import bench  # noqa: E402

import moe  # noqa: E402

MEASURES = ("moe/", "accel_kernels/")
SHAPES = {  # name: (tokens, d_model, d_ff, experts, top_k, transformers family)
    "qwen3_30b_a3b": (16384, 2048, 768, 128, 8, "qwen3_moe"),
    "mixtral_8x7b": (8192, 4096, 14336, 8, 2, "mixtral"),
    "ep8_shard": (8192, 2048, 1024, 4, 2, "qwen3_moe"),
    "unaligned": (16384, 2064, 784, 128, 4, "qwen3_moe"),
    "aligned": (16384, 2048, 768, 128, 4, "qwen3_moe"),
}
SMALL = {"qwen3_30b_a3b": (128, 64, 32, 16, 4, "qwen3_moe"),
         "mixtral_8x7b": (128, 64, 96, 8, 2, "mixtral"),
         "ep8_shard": (128, 64, 32, 4, 2, "qwen3_moe"),
         "unaligned": (128, 80, 48, 16, 4, "qwen3_moe"),
         "aligned": (128, 64, 32, 16, 4, "qwen3_moe")}
RECIPES = {"bf16": {}, "fp8_all": dict(dispatch_dtype="fp8", combine_grad_dtype="fp8",
                                       gemm_dtype="fp8", dgrad_dtype="fp8", wgrad_dtype="fp8"),
           "fp8_gemm_dgrad": dict(dispatch_dtype="fp8", combine_grad_dtype="fp8",
                                  gemm_dtype="fp8", dgrad_dtype="fp8")}
MIN_COS = {"bf16": 0.99, "fp8": 0.97}  # y, dx and every weight gradient against the HF block


def parse_args(argv=None):
    p = bench.parser(__doc__, 2)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"from {','.join(SHAPES)}")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds (5; small 2)")
    p.add_argument("--recipes", default="bf16,fp8_all", help=f"moe's, from {','.join(RECIPES)}")
    p.add_argument("--transports", default="dropless,dense")
    p.add_argument("--moe-only", action="store_true", help="time moe alone (no torch needed)")
    p.add_argument("--profile", metavar="DIR", help="trace moe's variants: op breakdown")
    a = bench.parse(p, argv, small=dict(rounds=2, ceiling_n=256), full=dict(rounds=5,
                                                                            ceiling_n=8192))
    a.shapes, a.recipes = a.shapes.split(","), a.recipes.split(",")
    a.transports = a.transports.split(",")
    if bad := set(a.shapes) - set(SHAPES):
        p.error(f"unknown --shapes {sorted(bad)}; choose from {','.join(SHAPES)}")
    if a.recipes[0] != "bf16" or set(a.recipes) - set(RECIPES):
        p.error(f"--recipes must start with bf16 and name only {list(RECIPES)}")
    return a


def hf_config(name: str, shape) -> dict:
    """The transformers config values of a shape's block (also what moe.convert reads)."""
    t, d, f, e, k, family = shape
    if family == "mixtral":
        return dict(hidden_size=d, intermediate_size=f, num_local_experts=e,
                    num_experts_per_tok=k, router_jitter_noise=0.0, hidden_act="silu")
    return dict(hidden_size=d, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k,
                norm_topk_prob=True, hidden_act="silu")


def block_weights(shape, seed: int) -> dict[str, np.ndarray]:
    """One block's random weights in transformers 5's fused layout (``gate.weight [E, d]``,
    ``experts.gate_up_proj [E, 2f, d]``, ``experts.down_proj [E, d, f]``), bf16 values held
    as float32 so both frameworks read the same numbers."""
    t, d, f, e, k, _ = shape
    rng = np.random.default_rng(seed)
    return {"gate.weight": _bf16_normal(rng, (e, d), d**-0.5),
            "experts.gate_up_proj": _bf16_normal(rng, (e, 2 * f, d), d**-0.5),
            "experts.down_proj": _bf16_normal(rng, (e, d, f), f**-0.5)}


def inputs(shape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return {k: _bf16_normal(rng, shape[:2]) for k in ("x", "ct")}


def _bf16_normal(rng, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, np.float32) * scale).astype(ml_dtypes.bfloat16).astype(
        np.float32)


def moe_side(name, shape, weights, a):
    """``(params, options)`` of the block through ``moe.convert.from_transformers``."""
    params, opts = moe.convert.from_transformers(shape[5], weights, hf_config(name, shape))
    block = 32 if a.small else 128  # FP8 channels per scale: the largest dividing both widths
    while shape[1] % block or shape[2] % block:
        block //= 2
    return params, opts.replace(fp8_block_size=block)


def moe_variant(params, opts, x, transport: str, recipe: str, capacity_factor=None):
    """The jitted forward + backward of one moe variant and its arguments: ``fn(x, rk, wgu,
    wd, ct) -> ((y, dropped), (dx, d_router, d_gate_up, d_down))``."""
    o = opts.replace(transport=transport, capacity_factor=capacity_factor, **RECIPES[recipe])

    def loss(x, rk, wgu, wd, ct):
        y, aux = moe.moe_apply(x, rk, wgu, wd, options=o)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), (y, aux["dropped_slots"])

    step = jax.jit(lambda *args: (lambda r: (r[0][1], r[1]))(
        jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)))
    args = (jnp.asarray(x, jnp.bfloat16)[None], jnp.asarray(params["router_kernel"], jnp.float32),
            jnp.asarray(params["w_gate_up"], jnp.bfloat16),
            jnp.asarray(params["w_down"], jnp.bfloat16))
    return step, args


def useful_flops(shape) -> float:
    t, d, f, e, k, _ = shape
    return 6.0 * t * d * e + 18.0 * d * f * t * k  # the router and three GEMMs, fwd + bwd


def to_hf_grads(g) -> list[np.ndarray]:
    """moe's gradients (x [1, T, d], router [d, E], w_gate_up [E, d, 2f], w_down [E, f, d]) in
    the block's layout."""
    dx, dr, dgu, dd = (np.asarray(v, np.float32) for v in g)
    return [dx[0], dr.T, dgu.transpose(0, 2, 1), dd.transpose(0, 2, 1)]


def agreement(got, want, kind: str) -> dict:
    """Cosines of y (agreeing tokens) and each gradient against the reference; ``ok``."""
    names = ("y", "dx", "d_router", "d_gate_up", "d_down")
    cos = {}
    for n, g, w in zip(names, got, want, strict=True):
        g, w = np.asarray(g, np.float64).ravel(), np.asarray(w, np.float64).ravel()
        cos[n] = float(g @ w / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-30))
    return {"cos": cos, "min_cos": MIN_COS[kind], "ok": min(cos.values()) >= MIN_COS[kind]}


def torch_device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def hf_block(name, shape, weights):
    """transformers' sparse MoE block of the shape's family with ``grouped_mm`` experts, in
    bf16 on the GPU, holding ``weights``."""
    import torch
    if shape[5] == "mixtral":
        from transformers import MixtralConfig as Config
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        from transformers import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock as Block,
        )
    config = Config(**hf_config(name, shape), num_hidden_layers=1, num_attention_heads=16,
                    num_key_value_heads=16, experts_implementation="grouped_mm")
    config._experts_implementation = "grouped_mm"  # transformers 5: what the experts read
    block = Block(config).to(device=torch_device(), dtype=torch.bfloat16)
    block.load_state_dict({k: torch.tensor(v) for k, v in weights.items()}, strict=True)
    return block


def hf_step(block, x, ct):
    """``fn() -> (y, (dx, d_router, d_gate_up, d_down))`` of one block (eager or compiled)."""
    import torch
    params = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]

    def fn():
        xx = x.detach().requires_grad_(True)
        y = block(xx[None])
        y = y[0] if isinstance(y, tuple) else y
        return y, torch.autograd.grad(y, [xx, *params], ct[None])

    return fn


def torch_ceiling(n: int, iters: int) -> float:
    """TFLOP/s of a dense bf16 ``[n, n] @ [n, n]`` through torch (median of ``iters``)."""
    import torch
    a, b = (torch.randn(n, n, device=torch_device(), dtype=torch.bfloat16) for _ in range(2))
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    times = bench.interleaved({"mm": lambda: a @ b}, iters, warmup=3, sync=lambda _: sync())
    return 2.0 * n**3 / bench.medians(times)["mm"] / 1e12


def on_device(ct, torch_side: bool) -> tuple:
    """A cotangent as moe takes it (jax, ``[1, T, d]``) and as the block does (torch; None with
    ``--moe-only``), bf16 on the device."""
    dev = jnp.asarray(ct, jnp.bfloat16)[None]
    if not torch_side:
        return dev, None
    import torch
    return dev, torch.tensor(ct, device=torch_device(), dtype=torch.bfloat16)


def variants(name, shape, a, data, report):
    """Every variant's ``fn(cts) -> outputs`` (``cts``: :func:`on_device`'s pair), its kind and
    (dense) capacity factor."""
    weights = block_weights(shape, a.seed)
    params, opts = moe_side(name, shape, weights, a)
    report["shapes"][name]["fp8_block_size"] = opts.fp8_block_size
    out = {}
    if not a.moe_only:
        import torch
        blk = hf_block(name, shape, weights)
        x = torch.tensor(data["x"], device=torch_device(), dtype=torch.bfloat16)

        def hf(block):
            return lambda cts: hf_step(block, x, cts[1])()

        out["hf_eager"] = (hf(blk), "bf16", None, None)
        out["hf_compiled"] = (hf(torch.compile(blk)), "bf16", None, None)
        with torch.no_grad():
            data["hf_ids"] = blk.gate(x)[2].cpu().numpy()
    routed = moe.route(jnp.asarray(data["x"], jnp.bfloat16), jnp.asarray(params["router_kernel"]),
                       config=opts.router)
    data["moe_ids"] = np.asarray(routed.expert_ids)
    loads = np.asarray(routed.tokens_per_expert)
    cf = float(loads.max() / loads.mean()) * 1.01  # the dense capacity that drops nothing
    for transport in a.transports:
        for recipe in a.recipes:
            c = cf if transport == "dense" else None
            step, args = moe_variant(params, opts, data["x"], transport, recipe, c)
            out[f"moe_{recipe}_{transport}"] = (
                lambda cts, step=step, args=args: step(*args, cts[0]),
                "fp8" if recipe != "bf16" else "bf16", c, (step, args))
    return out


def as_numpy(out) -> list[np.ndarray]:
    if isinstance(out[0], tuple):  # moe: ((y, dropped), grads)
        (y, _), grads = out
        return [np.asarray(y, np.float32)[0], *to_hf_grads(grads)]
    y, grads = out  # the block's torch tensors
    return [t.detach().float().cpu().numpy() for t in (y[0], *grads)]


def check(fns, data, a) -> tuple[dict, list[str]]:
    """Every variant against the reference (the eager block; moe bf16 dropless with
    ``--moe-only``) with the cotangent zeroed on tokens the two routers route differently."""
    ref_name = "moe_bf16_dropless" if a.moe_only else "hf_eager"
    same = np.ones(len(data["x"]), bool)
    if "hf_ids" in data:
        same = (np.sort(data["hf_ids"], 1) == np.sort(data["moe_ids"], 1)).all(1)
    cts = on_device(data["ct"] * same[:, None], not a.moe_only)
    results, passed, outs = {"routing_mismatch_frac": float(1 - same.mean())}, [], {}
    for k, (fn, *_) in fns.items():
        try:
            outs[k] = as_numpy(fn(cts))
        except Exception as err:  # noqa: BLE001  (a variant this shape cannot run)
            results[k] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:1000]}
            print(f"  {k}: FAILED {err!r}"[:500], flush=True)
    for k, (_, kind, *_) in fns.items():
        if k not in outs or ref_name not in outs:
            continue
        got = [outs[k][0][same], *outs[k][1:]]
        want = [outs[ref_name][0][same], *outs[ref_name][1:]]
        results[k] = agreement(got, want, kind)
        passed += [k] if results[k]["ok"] else []
        print(f"  check {k}: min cos {min(results[k]['cos'].values()):.4f}", flush=True)
    return results, passed


def run_shape(name, a, report) -> None:
    shape = (SMALL if a.small else SHAPES)[name]
    data = inputs(shape, a.seed)
    fns = variants(name, shape, a, data, report)
    checks, passed = check(fns, data, a)
    report["checks"][name] = checks
    cts = on_device(data["ct"], not a.moe_only)
    sync = bench.interleaved({k: (lambda f=fns[k][0]: finish(f(cts))) for k in passed}, a.rounds,
                             warmup=1, sync=lambda out: out)
    for k, sec in bench.medians(sync).items():
        rate = report["ceilings"]["torch" if k.startswith("hf") else "jax"]
        report["rows"].append({"shape": name, "variant": k, "ms": sec * 1e3, "mfu": useful_flops(
            shape) / sec / 1e12 / rate, "capacity_factor": fns[k][2], "ok": True})
    for k in set(fns) - set(passed):
        report["rows"].append({"shape": name, "variant": k, "ok": False})
    for row in report["rows"] if a.profile else []:
        if row["shape"] == name and row["ok"] and row["variant"].startswith("moe_"):
            step, args = fns[row["variant"]][3]
            full = (*args, cts[0])
            row.update(bench.trace_profile(step.lower(*full).compile(), full, os.path.join(
                a.profile, f"{name}_{row['variant']}"), 3))
    report.update(summarize(report["rows"]))  # each shape's record complete as it ends
    bench.write_json(a.out, report)


def finish(out):
    """Wait for a variant's work (jax arrays, or the GPU's queue for torch)."""
    if isinstance(out[0], tuple):
        return jax.block_until_ready(out)
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def summarize(rows: list[dict]) -> dict:
    """The record's keys from the timed rows: per shape the faster HF variant's time over
    moe's (bf16 and the best FP8 recipe, dropless; ``..._dense_...``), moe's bf16 MFU, and
    the unaligned widths' MFU over the aligned ones'."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ms = {r["variant"]: r["ms"] for r in rows if r["shape"] == shape and "ms" in r}
        mfu = {r["variant"]: r["mfu"] for r in rows if r["shape"] == shape and "mfu" in r}
        hf = min((v for k, v in ms.items() if k.startswith("hf_")), default=None)
        for t, sfx in (("dropless", ""), ("dense", "_dense")):
            fp8 = [v for k, v in ms.items() if k.startswith("moe_fp8") and k.endswith(t)]
            if hf and f"moe_bf16_{t}" in ms:
                out[f"bf16{sfx}_over_best_hf_{shape}"] = hf / ms[f"moe_bf16_{t}"]
            if hf and fp8:
                out[f"fp8{sfx}_over_best_hf_{shape}"] = hf / min(fp8)
        if "moe_bf16_dropless" in mfu:
            out[f"bf16_mfu_{shape}"] = mfu["moe_bf16_dropless"]
        if "hf_eager" in ms and "hf_compiled" in ms:
            out[f"hf_compiled_over_eager_time_{shape}"] = ms["hf_compiled"] / ms["hf_eager"]
    if "bf16_mfu_unaligned" in out and "bf16_mfu_aligned" in out:
        out["unaligned_mfu_over_aligned"] = out["bf16_mfu_unaligned"] / out["bf16_mfu_aligned"]
    return out


def main(argv=None) -> dict:
    a = parse_args(argv)
    if not a.moe_only and not all(map(importlib.util.find_spec, ("torch", "transformers"))):
        print("vs_transformers.py: needs torch and transformers (pip install torch "
              "transformers), which are not installed here; nothing measured (--moe-only "
              "times the moe side alone).", file=sys.stderr)
        raise SystemExit(2)
    env = bench.env()
    report = {"benchmark": "layer_vs_transformers", "env": env, "settings": bench.settings(a),
              "device": env["device_kind"], "commit": env["commit"], "rows": [], "checks": {},
              "shapes": {k: dict(zip(("tokens", "d_model", "d_ff", "experts", "top_k",
                                      "family"), (SMALL if a.small else SHAPES)[k], strict=True))
                         for k in a.shapes}}
    ceiling = bench.dense_ceiling(a.ceiling_n, 2, 5 if a.small else 10)["tflops"]
    report["ceilings"] = {"jax": ceiling}
    if not a.moe_only:
        import torch
        report["ceilings"]["torch"] = torch_ceiling(a.ceiling_n, 5 if a.small else 10)
        report["software"] = {"torch": torch.__version__,
                              "transformers": importlib.import_module("transformers").__version__}
    for name in a.shapes:
        print(f"{name}: {report['shapes'][name]}", flush=True)
        try:
            run_shape(name, a, report)
        except Exception as err:  # noqa: BLE001  (one shape failing must not lose the rest)
            report["checks"][name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            print(f"{name}: FAILED {err!r}"[:1000], flush=True)
        jax.clear_caches()
        if not a.moe_only:
            import torch
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    report.update(summarize(report["rows"]))
    bench.print_table(report["rows"], ["shape", "variant", "ms", "mfu", "capacity_factor", "ok"])
    print({k: round(v, 3) for k, v in report.items() if "_over_" in k or "_mfu_" in k})
    bench.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()

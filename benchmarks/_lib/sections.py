"""The sections of BENCHMARKS.md, each a function of the current records ``C`` (name -> the
parsed ``current/<name>.json``, its freshness under ``_status``) returning markdown lines: what
it measures and how, a table with the headline ratio first, and each record's :func:`source`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from _lib.figures import BY_NAME, FIGURES, gmm_row

Lines = list[str]


def table(header: list[str], rows: list[list]) -> Lines:
    """A markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def fig(C: dict, name: str) -> str:
    """A named figure as printed (the same text README.md and docs/ quote)."""
    f = BY_NAME[name]
    return f.text(C[f.source]["results"])


def ceiling_text(c: dict) -> str:
    parts = []
    if "dense_bf16_tflops" in c:
        parts.append(f"bf16 {c['dense_bf16_tflops']:.0f}")
    if "dense_fp8_tflops" in c:
        parts.append(f"FP8 {c['dense_fp8_tflops']:.0f}")
    if parts:
        return "ceiling " + " / ".join(parts) + " TFLOP/s (" + c.get("what", "") + ")"
    if "limit_seconds_f32" in c:
        return (f"limit {c['limit_seconds_f32']:.3f} s (f32 params) / "
                f"{c['limit_seconds_bf16']:.3f} s (bf16): {c['what']}")
    if "gemm_tflops" in c:
        return (f"replay rates bf16 GEMM {c['gemm_tflops']:.0f}, FP8 {c['fp8_gemm_tflops']:.0f} "
                f"TFLOP/s, HBM {c['hbm_GBps']:.0f} GB/s "
                f"({c.get('rates', 'measured in the call')}), links "
                f"{c['link_GBps']:.0f} GB/s per GPU, {c['inter_host_GBps']:.0f} across hosts "
                "(assumed)")
    return "ceiling: " + c.get("what", "not recorded")


def source(C: dict, name: str) -> Lines:
    """The line saying where a section's figures come from, and whether they are dated."""
    r = C[name]
    sw = r["software"]
    note = f" Note: {r['note']}." if r.get("note") else ""
    return [f"Source: [`current/{name}.json`](benchmarks/results/current/{name}.json), "
            f"{r['hardware']}, jax {sw['jax']}, Python {sw['python']}, "
            + "".join(f"{k} {v}, " for k, v in sw.items() if k not in ("jax", "python"))
            + f"commit `{r['commit']}`, "
            f"{r['date']}; {ceiling_text(r['ceiling'])}. Command: `{r['command']}`"
            + (f" (today: `{r['rerun']}`)" if r.get("rerun") else "")
            + f".{note}{r['_status'].text(r)}"]


def x(v: float, d: int = 2) -> str:
    return f"{v:.{d}f}x"


def ms(v: float, d: int = 2) -> str:
    return f"{v:.{d}f}"


def _chunked(stem: str, *chunks: int) -> tuple:
    return tuple((f"{stem}_chunks{k}", k) for k in chunks)


# (label, ((case, chunks), ...)): schedule8.py's compiled programs, in the table's order.
_SCHEDULE_CASES = (
    ("MoE EP=8, A, dense", _chunked("moe_ep8_A_dense", 1, 2, 4)),
    ("MoE EP=8, A, dropless", _chunked("moe_ep8_A_dropless", 1, 2, 4)),
    ("MoE EP=8, B, dense", _chunked("moe_ep8_B_dense", 1, 2)),
    ("MoE EP=8, B, dropless", _chunked("moe_ep8_B_dropless", 1, 2)),
    ("MoE EP=16 (2 hosts), A's per-device work, dense", _chunked("moe_ep16_A_dense", 1, 2, 4)),
    ("MoE EP=64 (8 hosts), A's per-device work, dense", _chunked("moe_ep64_A_dense", 1, 2, 4)),
    ("EP=8 within a host, 2 hosts data parallel, A", _chunked("moe_ep8x2hosts_A_dense", 1, 2)),
    ("sharded Muon, 8 GPUs, 1.6B f32 params: f32 / bf16 update gathers, then the same with "
     "`chunk_bytes=1` (one matrix per device per chunk)",
     (("muon_dp8_f32_gather", "-"), ("muon_dp8_bf16_gather", "-"),
      ("muon_dp8_f32_gather_chunk1", "-"), ("muon_dp8_bf16_gather_chunk1", "-"))),
    ("the same with bf16 gathers after bf16 reduce-scatters (`reduce_dtype=jnp.bfloat16`, not "
     "the default), then with `chunk_bytes=1`",
     (("muon_dp8_bf16_gather_bf16_reduce", "-"), ("muon_dp8_bf16_gather_bf16_reduce_chunk1", "-"))),
    ("`train_lm.py --preset gpu` step, mesh (1, 8): as `--pgle` runs it (4 chunks), 2 chunks, "
     "2 micro-batches of 2 chunks; then the same on mesh (2, 4)",
     (("train_step_mesh1x8", 4), ("train_step_mesh1x8_chunks2", 2),
      ("train_step_mesh1x8_micro2_chunks2", 2), ("train_step_mesh2x4", 4),
      ("train_step_mesh2x4_chunks2", 2), ("train_step_mesh2x4_micro2_chunks2", 2))),
    ("the same at 64 x 1024 tokens per GPU on the data-parallel mesh (8, 1): Muon (its "
     "defaults: one layer's expert banks per chunk), AdamW; then on mesh (4, 2)",
     (("train_step_mesh8x1", 1), ("train_step_mesh8x1_adamw", 1), ("train_step_mesh4x2", 4),
      ("train_step_mesh4x2_adamw", 4))),
)


def _xla_estimates(cases: dict, name: str) -> dict | None:
    """The case compiled on XLA's own latency estimates: kept inside the case by a compile, or
    as a case of its own (``NAME.xla_estimates``) by a replay of the modules."""
    c = cases.get(name, {})
    return c.get("xla_estimates") or cases.get(f"{name}.xla_estimates")


def schedules(C: dict) -> Lines:
    r = C["schedule8"]["results"]
    cases = r["cases"]
    rows, missing = [], []
    for label, named in _SCHEDULE_CASES:
        got = [(cases[n], k, _xla_estimates(cases, n)) for n, k in named
               if "all" in cases.get(n, {})]
        if not got:
            missing.append(label)
            continue
        windows = [c["payload_all_to_all"] for c, _, _ in got]
        rows.append([label,
                     " / ".join(f"{e['all']['exposed_fraction']:.1%}" if e else "-"
                                for _, _, e in got),
                     " / ".join(f"{c['all']['exposed_fraction']:.1%}" for c, _, _ in got),
                     " / ".join(str(k) for _, k, _ in got),
                     ", ".join(f"{w['windows_with_gemm']}/{w['windows']}" for w in windows)
                     if any(w["windows"] for w in windows) else "-",
                     " / ".join(f"{c['all']['step_us'] / 1e3:.1f}" for c, _, _ in got)])
    g = cases["gpu1_layer"]
    hw = r["hardware"]
    where = ("compiled on a CPU-only machine for the GPU that "
             f"`{r['target_config']}` describes, through `topology_mesh(target_config=...)`"
             if r.get("target_config") else "compiled on the one GPU")
    return (["## Overlap: 8-GPU programs compiled on one machine", "",
             "`benchmarks/schedule8.py` compiles steps for virtual 8-, 16- and 64-GPU "
             f"topologies ({where}) and replays each schedule with `xla_comm.schedule`: a "
             "compute stream at rates measured on a GPU "
             f"(bf16 GEMM {hw['gemm_tflops']:.0f} TFLOP/s, FP8 {hw['fp8_gemm_tflops']:.0f}, "
             f"HBM {hw['hbm_GBps']:.0f} GB/s) and a communication stream at "
             f"{hw['link_GBps']:g} GB/s per GPU within a host, {hw['inter_host_GBps']:g} across "
             "hosts. Exposed = time compute waits for collectives, over their time. Each step "
             "is compiled twice: first on XLA's own latency estimates, then with the modeled "
             "times handed to XLA's scheduler as a latency profile (`xla_comm.latency`); the "
             "other columns are the second compile's. "
             "A: 8192 tokens/device, d 2048, d_ff 1024, 32 experts, top-2, FP8 wires; B: d 4096, "
             "d_ff 2048, 64 experts, top-8; over 16 and 64 GPUs A's per-device work (4 local "
             "experts: 64 and 256 experts). The layer cases differentiate a loss linear in "
             "the output, which lets XLA drop the forward's combine: with the output used "
             "(`--loss square`) more is exposed (docs/benchmark_log.md). "
             + (f"The layer's default chunk counts in this run: dense "
                f"{r['defaults']['dense']}, dropless {r['defaults']['dropless']}. "
                if r.get("defaults") else "")
             + "The grouped GEMMs are charged for the rows balanced routing fills (their kernels "
             "skip the rest: `schedule_report(grouped_rows=...)`); the dropless programs still "
             "model longer steps than the dense ones, as their layout is sized for every row "
             "going to one device and XLA's element-wise passes run over all of it.",
             ""]
            + table(["program (fwd + bwd)", "exposed, XLA's estimates", "exposed, modeled "
                     "latencies", "chunks", "payload all-to-alls with GEMMs", "modeled step ms"],
                    rows)
            + ["", (f"Not compiled in this run: {'; '.join(missing)}; their last figures are in "
                    "docs/benchmark_log.md. " if missing else "")
               + f"The compute model against the one-GPU layer at A's per-device work: "
               f"predicted {g['predicted_s']['1'] * 1e3:.3f} ms, measured "
               f"{g['measured_s']['1'] * 1e3:.3f} ms ({g['model_error']['1']:+.1%}; 2 chunks "
               f"{g['model_error']['2']:+.1%}). The layer in 2 chunks on one GPU, where "
               f"nothing is sent: {fig(C, 'chunked_over_unchunked_1gpu')} the unchunked time "
               "(step wall time, median of 15 interleaved rounds; the same layer's traced "
               "device time, and later runs of it: docs/benchmark_log.md, Overlap). Sharded "
               "Muon's synthetic step has no backward pass: its collectives outlast its "
               "compute, so no order of its "
               f"work exposes less than {fig(C, 'sched_muon_dp8_floor')} of them "
               "(`ScheduleReport.exposed_floor_fraction`). In the trainer's data-parallel "
               "step Muon's reductions run under the backward pass and each layer's chunk "
               f"under the layers before it: {fig(C, 'sched_train_dp8')} of its collective "
               "time exposed on mesh (8, 1), a modeled step "
               f"{fig(C, 'sched_train_dp8_muon_over_adamw')} AdamW's there, and "
               f"{fig(C, 'sched_train_4x2')} on (4, 2)" + _muon_train(r) + "."
               + _two_stage(r),
               ""]
            + source(C, "schedule8") + [""])


def _muon_train(r: dict) -> str:
    """Where the Muon and data-parallel train cases were compiled, where the record says."""
    runs = r.get("muon_train_run", {}).get("runs", [])
    if not runs:
        return ""
    where = ", ".join(f"`{t['commit']}`" for t in runs)
    return f" (those and the Muon cases compiled at {where}, jax {r['muon_train_run']['jax']})"


def _two_stage(r: dict) -> str:
    """The exchange past one host, where the record holds its cases."""
    if "moe_ep64_two_stage_exposed_fraction" not in r:
        return ""
    t = r.get("two_stage_run", {})
    return (" Past one host, DeepSeek-V3's per-device work (8192 tokens, d 7168, d_ff 2048, "
            "top-8 in 4 of 8 host groups, FP8 dispatch, 2 chunks; compiled at "
            f"`{t.get('commit', '?')}`): the two-stage exchange sends "
            f"{r['moe_ep64_cross_host_bytes_ratio']:.2f}x the one-stage exchange's bytes "
            f"across hosts over 64 GPUs ({r['moe_ep16_cross_host_bytes_ratio']:.2f}x over 16); "
            f"exposed {r['moe_ep64_one_stage_exposed_fraction']:.1%} -> "
            f"{r['moe_ep64_two_stage_exposed_fraction']:.1%} (64 GPUs), "
            f"{r['moe_ep16_one_stage_exposed_fraction']:.1%} -> "
            f"{r['moe_ep16_two_stage_exposed_fraction']:.1%} (16); modeled step "
            f"{r['moe_ep64_two_stage_step_over_one_stage']:.3f}x (64), "
            f"{r['moe_ep16_two_stage_step_over_one_stage']:.3f}x (16). Shape A's top-2 with two "
            f"stages forced: {r['moe_ep16_A_two_stage_step_over_one_stage']:.2f}x / "
            f"{r['moe_ep64_A_two_stage_step_over_one_stage']:.2f}x the one-stage step, so "
            "`host_axis='auto'` keeps one stage where a token's slots may reach as many hosts "
            "as it has slots.")


def method(C: dict) -> Lines:
    return ["## Method", "",
            "- GPU timings: warm-up calls, then the median of repeated calls timed with "
            "`jax.block_until_ready`, on random (never zero) inputs.",
            "- Every GPU run measures its own ceiling in the same process (a dense 8192^3 bf16 "
            "matmul, and FP8 where FP8 is timed) and reports ratios against it; ceilings moved "
            "by up to 10% between machine starts, so compare ratios, not milliseconds.",
            "- MFU = useful FLOPs (no padding; FP8 counted as bf16-equivalent) / (time x "
            "devices x the dense bf16 ceiling), so FP8 can pass 1.",
            "- A/B ratios interleave one call of each side per round, because separately timed "
            "runs drifted by 10-15%.",
            "- Overlap is counted in time: from `jax.profiler` traces (collective kernel time "
            "not covered by compute), or from a compiled schedule replayed by "
            "`xla_comm.schedule` (the time the compute stream waits for collectives).",
            "- Loss comparisons train the same batches (a pure function of seed and step) "
            "for the same steps.",
            "- Not measured: more than two GPUs (no such machine was lent: the 8- and 16-GPU "
            "figures below are compiled schedules replayed in time, not runs), and TPUs.",
            "- Dated: each record names the source paths it measures; once a later commit "
            "changes them (`git log COMMIT..HEAD -- PATHS`) its figures are history, marked "
            "**dated** here and *(at COMMIT, since changed)* where README.md or docs/ quote "
            "them, until a new run or a validation (`validated_at`: an A/B within 3% at a later "
            "commit) makes them current (`python3 benchmarks/report.py --stale` lists them).",
            ""]


def headline(C: dict) -> Lines:
    rows, links = [], anchors(C)
    for f in FIGURES:
        if not f.headline or f.source not in C:
            continue
        if f.source not in links:
            raise KeyError(f"current/{f.source}.json is cited by no section's source line.")
        r = C[f.source]
        met = f.met(r["results"])
        st = r["_status"]
        rows.append([f.label, f"**{f.text(r['results'])}**", f.target_text(),
                     {None: "-", True: "yes", False: "**no**"}[met],
                     f"{r['hardware'].split(' (')[0]}, `{r['commit']}`, {r['date']}"
                     + ("" if st.current else ", **dated**")
                     + f" ([{f.source}](#{links[f.source]}))"])
    dated = sorted({f.source for f in FIGURES if f.headline and f.source in C
                    and not C[f.source]["_status"].current})
    return (["## Headline figures", "",
             "Each row links to its section; README.md and docs/ quote these values. "
             + (f"{len(dated)} of the records behind them are dated (their code changed "
                "since; each section's source line says where)." if dated else
                "Every record behind them measured the code as it is."), ""]
            + table(["figure", "value", "target", "met", "hardware, commit, date"], rows)
            + [""])


def experts(C: dict) -> Lines:
    r, g = C["experts"]["results"], C["gmm"]["results"]
    lm = C["experts_lm_shapes"]["results"]
    gmm_rows = [[name, x(row["tflops"] / g["dense_bf16_tflops"]), ms(row["ms"], 3),
                 f"{row['tflops']:.0f}"]
                for name, k in (("Mosaic GPU, FP8", "mosaic_fp8"),
                                ("Mosaic GPU, bf16", "mosaic_bf16"),
                                ("Pallas Triton, bf16", "triton_bf16"))
                for row in [gmm_row(g, k)]]

    def pair(res, layout, routing):
        rows = [e for e in res["experts"] if e["layout"] == layout and e["routing"] == routing]
        b = next(e for e in rows if e["recipe"] == "bf16")
        f8 = next(e for e in rows if e["recipe"] == "fp8_all")
        return [f"**{x(b['ms'] / f8['ms'])}**", ms(b["ms"]), ms(f8["ms"]),
                f"{f8['bf16_equiv_mfu']:.3f}"]

    ex_rows = [["ragged, balanced", *pair(r, "ragged", "balanced")],
               ["ragged, Zipf (s = 1)", *pair(r, "ragged", "zipf")],
               ["padded [E, C, d], balanced", *pair(r, "padded", "balanced")],
               ["LM layer shape, ragged, balanced", *pair(lm, "ragged", "balanced")],
               ["LM layer shape, ragged, Zipf", *pair(lm, "ragged", "zipf")]]
    t = C["experts_2gpu"]["results"]["grouped_gemm_by_routing"]
    old = "; ".join(f"{b} {t[k + '/balanced']:.3f} balanced, {t[k + '/zipf']:.3f} Zipf"
                    for b, k in (("Pallas Triton (GPUs before Hopper)", "pallas"),
                                 ("padded einsum (every expert padded to the largest)",
                                  "einsum"), ("XLA `ragged_dot`", "ragged_dot")))
    return (["## Grouped GEMM and gated experts", "",
             "The grouped GEMM alone (gate_up forward: 32,768 rows, 4096 -> 4096, 8 groups), "
             "then gated experts forward + backward (y and the gradients of x and both weights) "
             "at 32,768 tokens, d_model 4096, d_ff 2048, 8 experts, and at one layer of the LM "
             "step (131,072 rows, d_model 2048, d_ff 1408, 16 experts). FP8 = all six GEMMs "
             "with e4m3 operands; only useful FLOPs count.", ""]
            + table(["grouped GEMM kernel", "rate / dense bf16", "ms", "TFLOP/s"], gmm_rows)
            + [""] + source(C, "gmm") + [""]
            + table(["gated experts fwd + bwd", "FP8 speedup", "bf16 ms", "FP8 ms",
                     "FP8 MFU"], ex_rows)
            + ["", f"Worst cosine of any FP8 output or gradient against bf16: "
               f"{fig(C, 'experts_fp8_worst_cos')}.", ""]
            + source(C, "experts") + [""] + source(C, "experts_lm_shapes") + [""]
            + [f"The other backends, gated experts' useful rate over the dense rate (an older "
               f"run on two GPUs): {old}.", ""] + source(C, "experts_2gpu") + [""])


def fp8_dense(C: dict) -> Lines:
    r = C["fp8_dense"]["results"]
    rows = []
    for label, shape in (("QKV, 65536 x 2048 x 6144", [65536, 2048, 6144]),
                         ("output, 65536 x 2048 x 2048", [65536, 2048, 2048])):
        by = {e["recipe"]: e for e in r["dense"] if e["shape"] == shape}
        rows.append([label, f"**{x(by['all']['speedup_vs_bf16'])}**",
                     x(by["forward"]["speedup_vs_bf16"]),
                     x(by["forward_dgrad"]["speedup_vs_bf16"]),
                     f"{ms(by['bf16']['ms'])} ({by['bf16']['tflops']:.0f} TFLOP/s)"])
    return (["## FP8 projections (`moe.fp8_dense`)", "",
             "`x @ W` with e4m3 operands through the experts' FP8 GEMMs, forward + backward "
             "(W an f32 param), against the bf16 matmul `nnx.Linear` computes; the shapes are "
             "the LM step's attention projections.", ""]
            + table(["projection", "all three GEMMs FP8", "FP8 forward", "+ FP8 dgrad",
                     "bf16 ms"], rows)
            + ["", f"Worst cosine against bf16 (y, dx, dW): {fig(C, 'fp8_dense_worst_cos')}.",
               ""] + source(C, "fp8_dense") + [""])


def layer_1gpu(C: dict) -> Lines:
    d = C["dropless"]["results"]
    rows = [["dropless, balanced (the default on one Hopper GPU)",
             f"**{d['dropless_over_capacity_time_1gpu']:.3f}**", ms(d["dropless_layer_ms_1gpu"]),
             f"{d['dropless_layer_mfu_1gpu']:.3f}", "0"],
            ["dropless, Zipf", f"**{d['dropless_over_capacity_time_1gpu_zipf']:.3f}**",
             ms(d["dropless_layer_ms_1gpu_zipf"]), f"{d['dropless_layer_mfu_1gpu_zipf']:.3f}",
             "0"],
            ["ragged, balanced", f"{d['ragged_over_capacity_time_1gpu']:.3f}",
             ms(d["ragged_layer_ms_1gpu"]), f"{d['ragged_layer_mfu_1gpu']:.3f}", "0"],
            ["capacity 1.25, einsum experts, balanced", "1", ms(d["capacity_layer_ms_1gpu"]),
             f"{d['capacity_layer_mfu_1gpu']:.3f}", f"{d['capacity_dropped_frac_1gpu']:.1%}"],
            ["capacity 1.25, Zipf", "1", ms(d["capacity_layer_ms_1gpu_zipf"]),
             f"{d['capacity_layer_mfu_1gpu_zipf']:.3f}",
             f"{d['capacity_dropped_frac_1gpu_zipf']:.1%}"]]
    f = C["fp8_layer"]["results"]
    e = C["experts"]["results"]
    db, df = (next(r for r in e["layer"] if r["transport"] == "dense" and r["variant"] == v)
              for v in ("bf16", "fp8"))
    fp8_rows = [["dropless", f"**{f['moe_layer_fp8_mfu_1gpu_dropless']:.3f}**",
                 f"{f['moe_layer_bf16_mfu_1gpu_dropless']:.3f}",
                 ms(f["moe_layer_fp8_ms_1gpu_dropless"]), ms(f["moe_layer_bf16_ms_1gpu_dropless"]),
                 x(f["moe_layer_fp8_speedup_1gpu"])],
                ["dense, capacity 1.25", f"**{df['mfu']:.3f}**", f"{db['mfu']:.3f}",
                 ms(df["ms"]), ms(db["ms"]), x(db["ms"] / df["ms"])]]
    return (["## The MoE layer on one GPU", "",
             "Forward + backward of the whole layer (router, dispatch, experts, combine) at "
             "16,384 tokens, d_model 4096, d_ff 2048, 16 experts, top-2; time ratios from "
             "interleaved A/B timing. With one device on the expert axis nothing is sent.", ""]
            + table(["layer, bf16", "time / capacity layer", "ms", "MFU", "slots dropped"], rows)
            + [""] + source(C, "dropless") + ["",
               "FP8 dispatch and all six expert GEMMs in FP8 (MFU in bf16-equivalent FLOPs):",
               ""]
            + table(["transport", "FP8 MFU", "bf16 MFU", "FP8 ms", "bf16 ms", "FP8 speedup"],
                    fp8_rows)
            + [""] + [source(C, "fp8_layer")[0] + " The dense row is from "
                      f"`current/experts.json` (commit `{C['experts']['commit']}`).", ""])


def lm_step(C: dict) -> Lines:
    r = C["lm_step"]["results"]
    s = {v["variant"]: v for v in r["steps"]}
    b, f = s["bf16"], s["fp8_proj"]
    rows = [["bf16", "1", ms(b["step_ms"], 1), f"{b['tokens_per_s']:,.0f}", f"{b['mfu']:.3f}"],
            ["FP8 wire, expert GEMMs and attention projections (`fp8_proj`)",
             f"**{x(r['lm_step_fp8_speedup'], 3)}**", ms(f["step_ms"], 1),
             f"{f['tokens_per_s']:,.0f}", f"{f['mfu']:.3f}"]]
    reg = [("optimizer (element-wise; Newton-Schulz GEMMs are in rest)", "optimizer"),
           ("experts (Mosaic GEMMs, quantization)", "experts"),
           ("dispatch, combine, router", "dispatch_combine"),
           ("rest (cuBLAS GEMMs, cuDNN attention, norms, loss)", "rest")]
    bu, fu = b["breakdown"], f["breakdown"]
    kt = [[label, ms(bu["us_per_region"][k] / 1e3, 1), ms(fu["us_per_region"][k] / 1e3, 1)]
          for label, k in reg]
    kt.append(["all GEMM kernels", ms(bu["us_per_step"]["gemm"] / 1e3, 1),
               ms(fu["us_per_step"]["gemm"] / 1e3, 1)])
    kt.append(["total kernel time", ms(bu["total_us_per_step"] / 1e3, 1),
               ms(fu["total_us_per_step"] / 1e3, 1)])
    st = r["settings"]
    return (["## The LM train step, one GPU", "",
             f"`benchmarks/lm_step.py`: `examples/lm_model.py` at d_model {st['d_model']}, "
             f"{st['layers']} layers, {st['experts']} experts top-{st['top_k']}, d_ff "
             f"{st['d_ff']} ({b['params_total'] / 1e9:.2f}B params, "
             f"{b['params_active'] / 1e6:.0f}M active), batch {st['batch']} x {st['seq_len']}, "
             "bf16 compute, sharded Muon, cuDNN attention; MFU counts attention FLOPs.", ""]
            + table(["variant", "speedup", "step ms", "tokens/s", "MFU"], rows)
            + ["", "Kernel time per step, ms (3 traced steps):", ""]
            + table(["region", "bf16", "`fp8_proj`"], kt)
            + ["", f"FP8 takes {fig(C, 'lm_step_gemm_saving_ms')} ms of GEMM kernel time off "
               "each step; its quantization kernels and transposes give part of it back.", ""]
            + source(C, "lm_step") + [""])


def muon_1gpu(C: dict) -> Lines:
    r = C["muon_step_1gpu"]["results"]
    u, n, lim = r["update_s"], r["ns_s"], r["limit_s"]
    o = next(k for k in u if k != "1")
    how = ("`ns_symmetric_blocks=4` (`X X^T` and `A (cA + bI)` from one block triangle in 4 "
           "row strips)" if o == "4" else f"`ns_symmetric_blocks={o!r}`")
    params = r.get("params") or r["f32_params"]["model"]["params"]
    return (["## Muon on one GPU: Newton-Schulz's symmetric products", "",
             "`benchmarks/muon_step.py --param-dtypes f32 --variants muon,ns --symmetric-blocks "
             f"1,{o}`: the {params / 1e9:.2f}B-parameter set (f32 master params, bf16 "
             "Newton-Schulz operands) on one device. The update (momentum, Newton-Schulz, "
             f"scaling, apply) took {u['1']:.3f} s ({u['1'] / lim['1']:.2f}x the plain form's "
             f"Newton-Schulz FLOPs at the dense rate) with plain matmuls and {u[o]:.3f} s "
             f"({u[o] / lim[o]:.2f}x) with {how}: **{fig(C, 'muon_symmetric_speedup')}**; "
             f"Newton-Schulz alone {n['1']:.3f} -> {n[o]:.3f} s. "
             + source(C, "muon_step_1gpu")[0] + " " + _muon_speed(C)[0], ""])


def _muon_speed(C: dict) -> Lines:
    r = C["muon_speed"]["results"]
    ms, t = r["muon_step"], r["trainer"]["median_step_ms"]
    plain = r["trainer_standard"]["median_step_ms"]["muon"]
    race = r["trainer"]["summary"]["time_to_adamw_final_loss"]
    strips = {(w["m"], w["n"], w["batch"]): w["ratio_to_plain"]["4"]
              for w in r["ns_strips"]["by_batch"]}
    names = {"standard_sym4": "4 row strips", "standard_tiles": "the tile kernel",
             "auto": "`'auto'` (the tile kernel, and the Gram form on banks at least twice as "
                     "wide as tall)", "gram_sym4": "the Gram form with 4 strips"}
    std = ms["standard"]["update_s"]
    variants = "; ".join(f"{names.get(k, k)} {v['update_s']:.3f} s ({v['update_s'] / std:.3f}x)"
                         for k, v in ms.items() if k != "standard")
    return ([f"The issue-36 run (`benchmarks/run_muon_speed.sh` at `0afc61a`): the 1.62B "
             f"update took "
             f"{std:.3f} s plain; {variants}. The fastest, {r['fastest_variant']}, is "
             f"**{r['ns_time_ratio_vs_standard']:.3f}x** plain and "
             f"{r['ns_time_ratio_vs_54b8671']:.3f}x the H200 0.2905 s of `54b8671` (target "
             "0.6x). Every variant's distance to the exact polar factor was within "
             f"{max(r['accuracy']['worst_ratio'].values()):.3f}x the plain form's. In the "
             f"trainer's GPU preset (its d-1024 expert banks stay on plain matmuls) Muon's step "
             f"took {t['muon'] / t['adamw']:.3f}x AdamW's with the defaults and "
             f"{plain / t['adamw']:.3f}x with the plain form forced (target 1.08x), at final "
             f"losses {r['loss_parity_delta']:+.4f} nats/byte apart; Muon reached AdamW's final "
             "validation loss in "
             f"{race['muon_time_to_adamw_final_loss_fraction']:.2f}x AdamW's training time "
             + (f"(after {race['muon_time_to_adamw_final_loss_fraction_after']:.2f}x, the "
                "evaluation before) "
                if race.get("muon_time_to_adamw_final_loss_fraction_after") is not None else "")
             + "(target 0.5x). By matrix size (`benchmarks/ns_strips.py` at "
             f"`{r['ns_strips']['commit'].split()[0]}`, 4 strips over plain): "
             + ", ".join(f"{b} x {m}x{n} {strips[(m, n, b)]:.2f}x" for m, n, b in (
                 (1024, 2816, 32), (2048, 2048, 32), (2048, 5632, 32), (4096, 4096, 1),
                 (4096, 4096, 8), (4096, 11264, 32)))
             + ". " + source(C, "muon_speed")[0], ""])


def _dispatch_rows(d: dict) -> list[list]:
    """The exchange table of a dispatch record: dispatch.py's, or the older run's (its
    ``dispatch_check`` and ``dispatch_phases`` parts)."""
    chk = d.get("dispatch_check", d)
    ab, tm = chk["dispatch_ab"], {(t["transport"], t["wire"]): t for t in chk["timings"]}
    if "dispatch_phases" in d:
        ph = {(p["phase"], p["wire"]): p for p in d["dispatch_phases"]["phases"]}
        mat = "dispatch+combine fwd (expert_x materialized)"
        dc = {w: (ph[(mat, w)]["ms"], ph[(mat, w)]["GBps_remote"]) for w in ("bf16", "fp8")}
        a2a = {w: (ph[("all_to_all alone", w)]["ms"], ph[("all_to_all alone", w)]["GBps_remote"])
               for w in ("bf16", "fp8")}
    else:
        dc = {w: (tm[("dense", w)]["fwd_ms"], tm[("dense", w)]["fwd_GBps_remote"])
              for w in ("bf16", "fp8")}
        a2a = {w: (d["all_to_all"][w]["ms"], d["all_to_all"][w]["GBps_remote"])
               for w in ("bf16", "fp8")}

    def pair(label, v):
        return [label, f"{v['fp8'][0] / v['bf16'][0]:.3f}",
                *(f"{v[w][0]:.3f} ({v[w][1]:.0f})" for w in ("bf16", "fp8"))]

    rag = {w: tm[("ragged", w)]["dispatch_fwd_ms"] for w in ("bf16", "fp8")}
    return [["dispatch, A/B interleaved, wire kernels (default)",
             f"**{ab['auto']['ratio_of_medians']:.3f}**", ms(ab["auto"]["bf16_ms"], 3),
             ms(ab["auto"]["fp8_ms"], 3)],
            ["dispatch, A/B, XLA wire path", f"{ab['xla']['ratio_of_medians']:.3f}",
             ms(ab["xla"]["bf16_ms"], 3), ms(ab["xla"]["fp8_ms"], 3)],
            pair("dispatch + combine fwd, expert layout materialized: ms (GB/s per GPU)", dc),
            pair("the all-to-all alone: ms (GB/s)", a2a),
            ["ragged transport (`ragged_all_to_all`), dispatch",
             f"{rag['fp8'] / rag['bf16']:.3f}", ms(rag["bf16"], 3), ms(rag["fp8"], 3)]]


def _layer_2gpu_rows(m: dict) -> list[list]:
    mfu, lms = m["moe_layer_mfu_by_variant"], m["moe_layer_ms_by_variant"]
    exp = m["moe_layer_exposed_comm_fraction_by_variant"]
    return [[label, f"**{mfu[k]:.3f}**" if i < 2 else f"{mfu[k]:.3f}", ms(lms[k]),
             f"{exp[k]:.3f}" if k in exp else "-"]
            for i, (label, k) in enumerate((
                ("dense transport, einsum experts, bf16 dispatch (default)", "dense_einsum_bf16"),
                ("the same, FP8 dispatch", "dense_einsum_fp8"),
                ("bf16, `xla_comm.overlap` compile options", "dense_einsum_bf16_overlap"),
                ("FP8, `xla_comm.overlap` compile options", "dense_einsum_fp8_overlap"),
                ("dense transport, Pallas Triton experts", "dense_pallas_bf16"),
                ("ragged transport, Pallas Triton experts", "ragged_pallas_bf16"),
                ("ragged transport, `ragged_dot` experts", "ragged_bf16"))) if k in mfu]


def _muon_2gpu_rows(mu: dict) -> list[list]:
    f32, b16 = mu["f32_params"], mu["bf16_params"]
    lf, lb = f32["limit"]["seconds"], b16["limit"]["seconds"]

    def cell(res, key, limit):
        return f"{res[key]['step_seconds']:.3f} ({res[key]['step_seconds'] / limit:.2f}x)"

    rows = [[label, cell(f32, k, lf), cell(b16, k, lb),
             " + ".join(f"{n} {c}" for c, n in f32[k]["counts"].items())]
            for label, k in (("`muon_jax.muon`, sharded (default)", "muon_jax_default"),
                             ("`muon_jax.muon` on FSDP-sharded params", "muon_jax_fsdp"),
                             ("`optax.contrib.muon`, replicated", "optax_contrib_muon"),
                             ("`optax.contrib.muon`, FSDP (XLA auto-sharding)",
                              "optax_contrib_muon_fsdp"))]
    rows[0][1] = f"**{rows[0][1]}**"
    return rows + [["limit: Newton-Schulz FLOPs at the dense rate + one all-reduce",
                    f"{lf:.3f}", f"{lb:.3f}", "-"]]


def two_gpus(C: dict) -> Lines:
    b16 = C["muon_step_2gpu"]["results"]["bf16_params"]
    lm = C["lm_step_2gpu"]["results"]["lm_step_by_variant"]
    on = lm.get("fp8_dispatch_on") or lm["fp8_dispatch"]
    off = lm.get("fp8_dispatch_off") or lm["bf16"]
    return (["## Two GPUs: dispatch, the layer at EP=2, sharded Muon", "",
             "Dispatch and combine at 16,384 tokens per GPU, d_model 4096, 16 experts, top-2, "
             "capacity 1.25 (dense transport unless named); FP8 = e4m3 rows with E8M0 block "
             "scales on the wire.", ""]
            + table(["exchange", "FP8 / bf16", "bf16 ms", "FP8 ms"],
                    _dispatch_rows(C["dispatch_2gpu"]["results"]))
            + [""] + source(C, "dispatch_2gpu") + ["",
               "The MoE layer, forward + backward, expert parallel over both GPUs (the shapes "
               "above; MFU over 2 x the dense rate; exposed = profiler collective time not under "
               "compute):", ""]
            + table(["variant", "MFU", "ms", "exposed communication"],
                    _layer_2gpu_rows(C["moe_layer_2gpu"]["results"]))
            + [""] + source(C, "moe_layer_2gpu") + ["",
               f"Sharded Muon, {b16['model']['params'] / 1e9:.2f}B parameters of LLaMA-like "
               f"matrices ({b16['model']['matrices']}), data parallel over 2 GPUs, gradients "
               "through `muon_jax.reduced_view` (one reduce-scatter); step in s (over the "
               "limit):", ""]
            + table(["variant", "f32 master params", "bf16 params", "collectives (f32)"],
                    _muon_2gpu_rows(C["muon_step_2gpu"]["results"]))
            + [""] + source(C, "muon_step_2gpu") + ["",
               f"The LM step at the lm_step shapes on both GPUs: {on['step_ms']:.1f} ms, "
               f"{on['tokens_per_s']:,.0f} tokens/s, MFU {on['mfu']:.3f} with FP8 dispatch "
               f"({off['step_ms']:.1f} ms without).", ""] + source(C, "lm_step_2gpu")
            + ["", "![dispatch ms](benchmarks/results/current/h200x2_dispatch_ms.png) "
               "![moe layer](benchmarks/results/current/h200x2_moe_layer.png)", ""])


def main_job_table(C: dict) -> Lines:
    r = C["train_lm_cpu"]["results"]["results"]
    return table(["optimizer", "final validation loss (nats/byte)", "bits/byte", "run, s"],
                 [["Muon (`muon_jax.muon`, lr 0.02 shared with its AdamW part, state sharded "
                   "over the 8 devices)", f"**{fig(C, 'main_job_muon')}**",
                   fig(C, "main_job_muon_bits"), f"{r['muon']['wall_s']:.0f}"],
                  ["AdamW (`optax.adamw`, lr 6e-3)", fig(C, "main_job_adamw"),
                   fig(C, "main_job_adamw_bits"), f"{r['adamw']['wall_s']:.0f}"]])


def _lr(v: float) -> str:
    """0.02 as 0.02, 1.2e-2 and 7.5e-4 in scientific notation (the way the trainer's flags read)."""
    if v >= 0.01 and abs(v * 100 - round(v * 100)) < 1e-9:
        return f"{v:g}"
    mantissa, exponent = f"{v:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def sweep_table(C: dict) -> Lines:
    rows = []
    for preset, name, key in (("CPU", "lr_sweep_cpu", "cpu"), ("GPU", "lr_sweep_gpu", "gpu")):
        r = C[name]["results"]
        for opt, label in (("muon", "Muon"), ("adamw", "AdamW")):
            runs = {run["lr"]: run["final_val_loss"] for run in r["runs"]
                    if run["optimizer"] == opt}
            best_lr = min(runs, key=runs.get)
            default = r[f"{key}_{opt}_default_lr"]
            rows.append([preset, label, _lr(default),
                         f"**{runs[default]:.3f}**" if opt == "muon" else f"{runs[default]:.3f}",
                         f"{runs[best_lr]:.3f} ({_lr(best_lr)})",
                         ", ".join(_lr(v) for v in sorted(runs))])
    return table(["preset", "optimizer", "default lr", "default", "best of the grid (lr)",
                  "grid"], rows)


def trainer(C: dict) -> Lines:
    g, c = C["fp8_parity_gpu"]["results"], C["fp8_parity_cpu"]["results"]
    prows = [["GPU preset (one H200, bf16 compute)", f"**{fig(C, 'fp8_loss_gpu')}**",
              f"{g['fp8_val_loss_300']:.4f}", f"{g['bf16_val_loss_300']:.4f}"],
             ["CPU preset (f32 compute), seed 0", f"**{fig(C, 'fp8_loss_cpu')}**",
              f"{c['fp8_val_loss']:.4f}", f"{c['bf16_val_loss']:.4f}"],
             ["CPU preset, seed 1", fig(C, "fp8_loss_cpu_seed1"),
              f"{c['seed_1']['fp8_val_loss']:.4f}", f"{c['seed_1']['bf16_val_loss']:.4f}"]]
    gd = C["muon_gather_dtype"]["results"]
    rd = C["muon_reduce_dtype"]["results"]
    ro = C["lr_sweep_gpu"]["results"]["router_optimizer"]
    return (["## The trainer", "",
             "`examples/train_lm.py`, 300 steps per run, final validation loss in nats/byte on "
             "held-out files. The README's main job (CPU preset, both optimizers):", ""]
            + main_job_table(C)
            + ["", f"Muon ends {fig(C, 'main_job_gap')} nats/byte lower at equal steps. Whole "
               f"run {fig(C, 'main_job_wall')}, compilation and data loading included.", ""]
            + source(C, "train_lm_cpu")
            + ["", "Learning-rate sweeps of both presets (the defaults are the trainer's):", ""]
            + sweep_table(C)
            + ["", f"Muon's default ends below AdamW's best by {fig(C, 'sweep_gap_cpu')} (CPU) "
               f"and {fig(C, 'sweep_gap_gpu')} (GPU). Router kernels on AdamW instead of Muon: "
               f"{ro['cpu_router_on_adamw_val_loss']:.3f} against "
               f"{ro['cpu_router_on_muon_val_loss']:.3f} (CPU), "
               f"{ro['gpu_router_on_adamw_val_loss']:.4f} against "
               f"{ro['gpu_router_on_muon_val_loss']:.4f} (GPU).", ""]
            + source(C, "lr_sweep_cpu") + [""] + source(C, "lr_sweep_gpu")
            + ["", "![GPU preset learning-rate sweep](docs/lr_sweep_gpu.png)"]
            + ["", "FP8 against bf16 (FP8 dispatch, `--fp8-gemms all --fp8-projections all`; "
               "Muon; target within 1%):", ""]
            + table(["preset", "FP8 / bf16 - 1", "FP8", "bf16"], prows)
            + [""] + source(C, "fp8_parity_gpu") + [""] + source(C, "fp8_parity_cpu")
            + ["", "Muon's update all-gathers in bf16 (`gather_dtype`), CPU preset, seeds "
               + ", ".join(str(x) for x in gd["seeds"]) + ": validation loss "
               + " / ".join(f"{x:.4f}" for x in gd["final_val_loss"]["bfloat16"])
               + " against " + " / ".join(f"{x:.4f}" for x in gd["final_val_loss"]["float32"])
               + f" in f32, {fig(C, 'muon_gather_bf16_delta')} on average with a seed-to-seed "
               f"spread of {gd['seed_std_float32']:.4f}: the default `'auto'` gathers bf16 "
               "after bf16 Newton-Schulz. "
               "Its data-parallel gradients reduce-scattered in bf16 (`reduce_dtype`, "
               "`--muon-reduce-dtype bfloat16`), CPU preset, seeds "
               + ", ".join(str(x) for x in rd["seeds"]) + ": validation loss "
               + " / ".join(f"{x:.4f}" for x in rd["final_val_loss"]["bfloat16"])
               + " against " + " / ".join(f"{x:.4f}" for x in rd["final_val_loss"]["float32"])
               + f" in f32, {rd['delta_bf16_minus_f32']:+.4f} on average (standard error "
               f"{rd['delta_standard_error']:.4f}). The default stays exact: XLA:CPU widens "
               "bf16 reduce-scatters, so a GPU ring's bf16 additions were not measured.", ""]
            + source(C, "muon_gather_dtype") + source(C, "muon_reduce_dtype") + [""])


def before_after(C: dict) -> Lines:
    h = C["house_ab"]["results"]
    house = [[pair, case, ms(c["base_ms"]), ms(c["new_ms"]), f"**{c['new_over_base']:.3f}**"]
             for pair, r in h["pairs"].items() for case, c in r["cases"].items()]
    return (["## Before and after: the house", "",
             "The house (one kernel layer, one registry, options resolved once, option "
             f"objects; `{h['base_commit']}` -> `{h['commit']}`): each workload built from "
             "both trees' packages in one process per pair, outputs checked equal, then timed "
             "interleaved; medians, ms.", ""]
            + table(["pair", "case", "before", "after", "after / before"], house)
            + ["", " ".join(source(C, "house_ab")), "",
               "Earlier before/after runs (the jax-0.12 kernels, the moe redesign): "
               "docs/benchmark_log.md.", ""])


def vs_transformers(C: dict) -> Lines:
    head = ["## The layer against transformers' MoE blocks", "",
            "`benchmarks/vs_transformers.py`: transformers' `Qwen3MoeSparseMoeBlock` and "
            "`MixtralSparseMoeBlock` with `grouped_mm` experts, eager and under "
            "`torch.compile`, against `moe.moe_apply` on the same weights and inputs (loaded "
            "through `moe.convert`), forward + backward, one GPU, one process; timed only after "
            "y, dx and every weight gradient agree (tokens the two routers route differently "
            "aside); medians of interleaved rounds. Ratios: the faster transformers variant's "
            "time over moe's (dropless; the dense transport at a capacity that drops nothing in "
            "brackets); MFU against the same process's dense bf16 rate.", ""]
    if "layer_vs_transformers" not in C:
        return head + ["Not run yet: `python3 benchmarks/vs_transformers.py --out OUT/"
                       "layer_vs_transformers.json` on a GPU with torch and transformers, then "
                       "`python3 benchmarks/report.py --adopt layer_vs_transformers OUT/"
                       "layer_vs_transformers.json`.", ""]
    r = C["layer_vs_transformers"]["results"]
    rows = []
    for name, sh in r["shapes"].items():
        by = {v["variant"]: v for v in r["rows"] if v["shape"] == name and "ms" in v}
        hf = min((v for k, v in by.items() if k.startswith("hf_")), key=lambda v: v["ms"],
                 default=None)
        if hf is None or f"bf16_over_best_hf_{name}" not in r:
            continue
        dense = r.get(f"bf16_dense_over_best_hf_{name}")
        rows.append([f"{name}: {sh['tokens']} x {sh['d_model']} -> {sh['d_ff']}, "
                     f"{sh['experts']} experts, top-{sh['top_k']}",
                     f"{hf['ms']:.2f} ({hf['variant'][3:]})",
                     f"**{x(r[f'bf16_over_best_hf_{name}'])}**"
                     + (f" ({x(dense)})" if dense else ""),
                     x(r[f"fp8_over_best_hf_{name}"]) if f"fp8_over_best_hf_{name}" in r else "-",
                     f"{r[f'bf16_mfu_{name}']:.3f}", f"{hf['mfu']:.3f}"])
    mism = max(c.get("routing_mismatch_frac", 0) for c in r["checks"].values())
    return (head + table(["shape", "transformers ms (variant)", "moe bf16", "moe FP8",
                          "moe bf16 MFU", "transformers MFU"], rows)
            + ["", "Widths that are multiples of 16 but not of 128 (d_model 2064, d_ff 784) "
               f"reach {r['unaligned_mfu_over_aligned']:.2f} of the MFU of 2048 / 768; at most "
               f"{mism:.1%} of the tokens were routed differently by the two routers.", ""]
            + source(C, "layer_vs_transformers") + [""])


def cpu_eager(C: dict) -> Lines:
    r = C["eager_layer"]["results"]
    return (["## CPU: the layer called eagerly", "",
             f"`moe.MoE` called outside `jit` ({r['tokens']} tokens, d_model {r['d_model']}, "
             f"{r['experts']} experts) runs through a cached jitted function: "
             f"{r['eager_s'] * 1e3:.2f} ms per call against {r['jit_s'] * 1e3:.2f} ms jitted "
             f"({fig(C, 'eager_over_jit')}; target <= 3x).", ""] + source(C, "eager_layer")
            + [""])


SECTIONS: tuple[Callable[[dict], Lines], ...] = (
    method, headline, experts, fp8_dense, layer_1gpu, vs_transformers, lm_step, muon_1gpu,
    two_gpus, schedules, trainer, before_after, cpu_eager)


def anchors(C: dict) -> dict[str, str]:
    """Each current file's link target for the headline table: the BENCHMARKS.md anchor (the
    heading as GitHub slugs it) of the first section whose source lines cite it."""
    out: dict[str, str] = {}
    for section in SECTIONS[2:]:
        lines = section(C)
        slug = re.sub(r"[^\w\- ]", "", lines[0].removeprefix("## ").lower()).replace(" ", "-")
        for name in re.findall(r"\(benchmarks/results/current/(\w+)\.json\)", "\n".join(lines)):
            out.setdefault(name, slug)
    return out


def blocks(C: dict) -> dict[str, str]:
    """The tables README.md and docs/ quote whole, as ``<!--block:NAME-->`` blocks."""
    def dated(*names):
        notes = [f"*{n}:{C[n]['_status'].text(C[n]).replace('**', '')}*" for n in names
                 if not C[n]["_status"].current]
        return ["", *notes] if notes else []

    return {"main_job": "\n".join(main_job_table(C) + dated("train_lm_cpu")),
            "lr_sweep": "\n".join(sweep_table(C) + dated("lr_sweep_cpu", "lr_sweep_gpu"))}


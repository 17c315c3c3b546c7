"""BENCHMARKS.md's section on the compiled multi-GPU schedules (``current/schedule8.json``,
written by ``benchmarks/schedule_report.py``): exposed communication per program, with XLA's
latency estimates and with the modeled ones."""

from __future__ import annotations

from report_common import Lines, fig, source, table

# (label, ((case, chunks), ...)): the compiled programs of schedule_report.py, in the order
# the table shows them.
_SCHEDULE_CASES = (
    ("MoE EP=8, A, dense", (("moe_ep8_A_dense_chunks1", 1), ("moe_ep8_A_dense_chunks2", 2),
                            ("moe_ep8_A_dense_chunks4", 4))),
    ("MoE EP=8, A, dropless", (("moe_ep8_A_dropless_chunks1", 1),
                               ("moe_ep8_A_dropless_chunks2", 2),
                               ("moe_ep8_A_dropless_chunks4", 4))),
    ("MoE EP=8, B, dense", (("moe_ep8_B_dense_chunks1", 1), ("moe_ep8_B_dense_chunks2", 2))),
    ("MoE EP=8, B, dropless", (("moe_ep8_B_dropless_chunks1", 1),
                               ("moe_ep8_B_dropless_chunks2", 2))),
    ("MoE EP=16 (2 hosts), A's per-device work, dense", (("moe_ep16_A_dense_chunks1", 1),
                                                         ("moe_ep16_A_dense_chunks2", 2),
                                                         ("moe_ep16_A_dense_chunks4", 4))),
    ("MoE EP=64 (8 hosts), A's per-device work, dense", (("moe_ep64_A_dense_chunks1", 1),
                                                         ("moe_ep64_A_dense_chunks2", 2),
                                                         ("moe_ep64_A_dense_chunks4", 4))),
    ("EP=8 within a host, 2 hosts data parallel, A", (("moe_ep8x2hosts_A_dense_chunks1", 1),
                                                      ("moe_ep8x2hosts_A_dense_chunks2", 2))),
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
             "`benchmarks/schedule_report.py` compiles steps for virtual 8-, 16- and 64-GPU "
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
             "experts: 64 and 256 experts). "
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
               "(`ScheduleReport.exposed_floor_fraction`).",
               ""]
            + source(C, "schedule8") + [""])

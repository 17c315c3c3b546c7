"""``benchmarks/schedule_report.py``'s command line and the summary of its JSON: the headline
keys (exposed fractions of the default configurations, recomputed from the cases), the
targets each is held to and whether it meets them."""

from __future__ import annotations

import argparse

TARGETS = {  # the overlap targets each headline key is held to
    "moe_ep8_exposed_fraction": 0.15, "moe_ep8_dropless_exposed_fraction": 0.15,
    "moe_ep8_B_exposed_fraction": 0.15, "moe_ep8_B_dropless_exposed_fraction": 0.15,
    "muon_dp8_exposed_fraction": 0.10, "train_step_ep8_exposed_fraction": 0.20,
    "chunked_over_unchunked_1gpu": 1.05,
}
HEADLINE = ("moe_ep8_exposed_fraction", "moe_ep8_dropless_exposed_fraction",
            "moe_ep8_dropless_unchunked_exposed_fraction", "moe_ep8_B_exposed_fraction",
            "moe_ep8_B_dropless_exposed_fraction", "muon_dp8_exposed_fraction",
            "muon_dp8_f32_gather_exposed_fraction", "muon_dp8_chunked_exposed_fraction",
            "muon_dp8_f32_gather_chunked_exposed_fraction", "muon_dp8_exposed_floor",
            "muon_dp8_f32_gather_exposed_floor", "muon_dp8_bf16_reduce_exposed_fraction",
            "muon_dp8_bf16_reduce_chunked_exposed_fraction", "muon_dp8_bf16_reduce_exposed_floor",
            "train_step_ep8_exposed_fraction",
            "train_step_2x4_exposed_fraction", "moe_ep16_exposed_fraction",
            "moe_ep64_exposed_fraction", "moe_ep8_windows", "moe_ep8_windows_with_gemm",
            "train_step_ep8_chunks2_exposed_fraction", "train_step_ep8_micro2_exposed_fraction",
            "moe_ep8_exposed_fraction_xla_estimates",
            "moe_ep8_dropless_exposed_fraction_xla_estimates",
            "muon_dp8_exposed_fraction_xla_estimates",
            "train_step_ep8_exposed_fraction_xla_estimates")


def grouped_rows(tokens: int, chunks: int, top_k: int, devices: int = 1,
                 local_first: bool = False):
    """The rows a chunk's grouped GEMMs compute under balanced routing (each device gets
    what it sends): the replay charges them, not the worst-case layout's static rows. With
    the first chunk's local pass (``local_first``) that pass takes 1 / devices of its chunk's
    rows and the chunk's exchanged pass the rest (by named scope,
    `xla_comm.costs.GroupedRows`).

    >>> grouped_rows(8192, 2, 2), grouped_rows(8192, 2, 2, 8, True)["moe_local_first"]
    (8192, 1024)
    """
    rows = tokens // chunks * top_k
    if not local_first:
        return rows
    return {"moe_local_first": rows // devices,
            "moe_chunk0/": rows - rows // devices, "": rows}


def summarize(report: dict, defaults: dict[str, int]) -> dict:
    """The report with its headline keys first, recomputed from ``report['cases']``.

    ``defaults``: the chunk counts the headline keys are for, by transport. A case that was not
    compiled (skipped for time, or a run cut short) gives None. ``targets`` and ``met`` say which
    keys hold their target (``moe_ep8_windows_with_gemm`` must equal ``moe_ep8_windows``).
    """
    cases = report["cases"]

    def frac(name, part="all"):
        c = cases.get(name)
        return None if c is None or part not in c else c[part]["exposed_fraction"]

    def floor(name):  # the least exposed share any order of the step's work reaches
        c = cases.get(name)
        return None if c is None else c["all"].get("exposed_floor_fraction")

    def xla_frac(name):  # the compile on XLA's own latency estimates (--latency-model)
        c = cases.get(name, {}).get("xla_estimates") or cases.get(f"{name}.xla_estimates")
        return None if c is None else c["all"]["exposed_fraction"]

    dn, dl = defaults["dense"], defaults["dropless"]
    head = {
        "moe_ep8_exposed_fraction": frac(f"moe_ep8_A_dense_chunks{dn}"),
        "moe_ep8_dropless_exposed_fraction": frac(f"moe_ep8_A_dropless_chunks{dl}"),
        "moe_ep8_dropless_unchunked_exposed_fraction": frac("moe_ep8_A_dropless_chunks1"),
        "moe_ep8_B_exposed_fraction": frac(f"moe_ep8_B_dense_chunks{dn}"),
        "moe_ep8_B_dropless_exposed_fraction": frac(f"moe_ep8_B_dropless_chunks{dl}"),
        # Muon's defaults gather bf16 updates (gather_dtype='auto' after bf16 Newton-Schulz)
        "muon_dp8_exposed_fraction": frac("muon_dp8_bf16_gather"),
        "muon_dp8_f32_gather_exposed_fraction": frac("muon_dp8_f32_gather"),
        "muon_dp8_chunked_exposed_fraction": frac("muon_dp8_bf16_gather_chunk1"),
        "muon_dp8_f32_gather_chunked_exposed_fraction": frac("muon_dp8_f32_gather_chunk1"),
        "muon_dp8_exposed_floor": floor("muon_dp8_bf16_gather"),
        "muon_dp8_f32_gather_exposed_floor": floor("muon_dp8_f32_gather"),
        # and, not by default, gradients reduce-scattered in bf16 (--muon-reduce-dtypes)
        "muon_dp8_bf16_reduce_exposed_fraction": frac("muon_dp8_bf16_gather_bf16_reduce"),
        "muon_dp8_bf16_reduce_chunked_exposed_fraction": frac(
            "muon_dp8_bf16_gather_bf16_reduce_chunk1"),
        "muon_dp8_bf16_reduce_exposed_floor": floor("muon_dp8_bf16_gather_bf16_reduce"),
        "train_step_ep8_exposed_fraction": frac("train_step_mesh1x8"),
        "train_step_2x4_exposed_fraction": frac("train_step_mesh2x4"),
        "moe_ep16_exposed_fraction": frac(f"moe_ep16_A_dense_chunks{dn}"),
        "moe_ep64_exposed_fraction": frac(f"moe_ep64_A_dense_chunks{dn}"),
        "train_step_ep8_chunks2_exposed_fraction": frac("train_step_mesh1x8_chunks2"),
        "train_step_ep8_micro2_exposed_fraction": frac("train_step_mesh1x8_micro2_chunks2"),
        "moe_ep8_exposed_fraction_xla_estimates": xla_frac(f"moe_ep8_A_dense_chunks{dn}"),
        "moe_ep8_dropless_exposed_fraction_xla_estimates": xla_frac(
            f"moe_ep8_A_dropless_chunks{dl}"),
        "muon_dp8_exposed_fraction_xla_estimates": xla_frac("muon_dp8_bf16_gather"),
        "train_step_ep8_exposed_fraction_xla_estimates": xla_frac("train_step_mesh1x8"),
    }
    def windows(*names):  # payload all-to-all windows, and those holding expert GEMMs
        a2a = [cases[k]["payload_all_to_all"] for k in names if k in cases]
        if not a2a:
            return None, None
        return sum(x["windows"] for x in a2a), sum(x["windows_with_gemm"] for x in a2a)

    head["moe_ep8_windows"], head["moe_ep8_windows_with_gemm"] = windows(
        f"moe_ep8_A_dense_chunks{dn}", f"moe_ep8_A_dropless_chunks{dl}")
    # the layer with local_first on (not its default: --local-first off,on)
    lf = {t: f"moe_ep8_A_{t}_local_first_chunks{n}" for t, n in (("dense", dn),
                                                                  ("dropless", dl))}
    if all(k in cases for k in lf.values()):
        for t, k in lf.items():
            base = cases.get(f"moe_ep8_A_{t}_chunks{defaults[t]}")
            head[f"moe_ep8_{t}_local_first_exposed_fraction"] = frac(k)
            head[f"moe_ep8_{t}_local_first_step_over_default"] = (
                None if base is None else cases[k]["all"]["step_us"] / base["all"]["step_us"])
        (head["moe_ep8_local_first_windows"],
         head["moe_ep8_local_first_windows_with_gemm"]) = windows(*lf.values())
    out = {**head, **{k: v for k, v in report.items() if k not in head}}
    out["defaults"] = dict(defaults)
    out["targets"] = {k: f"<= {v}" for k, v in TARGETS.items()} | {
        "moe_ep8_windows_with_gemm": "== moe_ep8_windows"}
    out["met"] = {k: out[k] <= v for k, v in TARGETS.items() if out.get(k) is not None}
    if head["moe_ep8_windows"] is not None:
        out["met"]["moe_ep8_windows_with_gemm"] = (head["moe_ep8_windows_with_gemm"]
                                                   == head["moe_ep8_windows"])
    return out


DESCRIPTION = """\
Exposed communication of 8-, 16- and 64-GPU steps predicted from their compiled schedules
(xla_comm.schedule on virtual topologies of the local GPU kind, nothing run on them): the MoE
layer's train step (shapes A and B, dense and dropless, per --chunks), sharded Muon on 8 GPUs,
train_lm's GPU-preset step; plus one timed EP=1 layer that checks the compute model. --small:
CPU, 8 simulated devices. JSON (--out): the summary keys, cases; --hlo-dir: every compiled
module (gzip)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU, 8 simulated devices")
    p.add_argument("--out", default=None)
    p.add_argument("--hlo-dir", default=None, help="write each compiled module here (gzip)")
    p.add_argument("--replay", default=None,
                   help="a tar (or folder) of modules an earlier run wrote (--hlo-tar): cases "
                        "found there are replayed with this run's rates instead of compiled")
    p.add_argument("--hlo-tar", default=None,
                   help="then pack them into this one tar file (up to 15 MiB, smallest first)")
    p.add_argument("--chunks", default="1,2,4", help="overlap_chunks values of the EP=8 cases")
    p.add_argument("--train-variants", default="1,2",
                   help="the trainer step's cases: micro_batches (examples/lm_model.py), "
                        "optionally xCHUNKS for the MoE layers' overlap_chunks (e.g. 1,2,2x1)")
    p.add_argument("--default-chunks", type=int, default=None,
                   help="the chunk count the headline keys are for (default: the layer's "
                        "moe.layer.OVERLAP_CHUNKS)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="per-GPU bandwidth within a host (default: xla_comm.schedule's, the "
                        "2x H200 all_to_all measurement)")
    p.add_argument("--inter-host-gbps", type=float, default=50.0)
    p.add_argument("--budget", type=float, default=500.0,
                   help="seconds after which the remaining cases are skipped")
    p.add_argument("--local-first", default="off",
                   help="local_first values of shape A's EP=8 MoE cases and of the 16- and "
                        "64-GPU ones (off: the layer's default; on adds cases named "
                        "..._local_first_chunksN)")
    p.add_argument("--muon-chunk-bytes", default="0,1",
                   help="chunk_bytes values of the Muon cases (0: the default, one collective "
                        "per stack; 1: one matrix per device per chunk)")
    p.add_argument("--muon-reduce-dtypes", default="f32",
                   help="reduce_dtype values of the Muon cases (f32: the default, the gradient "
                        "dtype; bf16 adds the bf16-gather cases with bf16 reduce-scatters)")
    p.add_argument("--summarize", default=None, metavar="REPORT_JSON",
                   help="compile nothing: recompute the headline keys of a report (e.g. one cut "
                        "short by a time limit) and write it to --out")
    p.add_argument("--parallel-collectives", type=int, default=1,
                   help="async collectives XLA's scheduler may keep in flight at once "
                        "(xla_comm.overlap's parallel_collectives; 1: XLA's default). A "
                        "--replay tar must come from a run with the same value")
    p.add_argument("--latency-model", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each multi-GPU step twice: the second time XLA's scheduler "
                        "plans with this report's modeled times (xla_comm.latency; default on, "
                        "off with --small); the first compile's figures stay under "
                        "'xla_estimates'")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an extra XLA compiler option for every compile (repeatable)")
    p.add_argument("--only", default=None, help="comma-separated case groups: "
                   "moe8,moe8b,muon,train,moe16,moe64,gpu1")
    p.add_argument("--target-config", default=None, metavar="TXTPB",
                   help="compile for the GPU this GpuTargetConfigProto text describes (e.g. "
                        "benchmarks/targets/h100.txtpb) instead of the local one: no GPU needed, "
                        "only jax's CUDA plugin; give --rates too where there is no GPU")
    p.add_argument("--rates", default=None, metavar="BF16,FP8,HBM",
                   help="the cost model's rates (bf16 and FP8 TFLOP/s, HBM GB/s) instead of "
                        "measuring them (a CPU-only machine compiling with --target-config)")
    p.add_argument("--rates-from", default=None, metavar="REPORT_JSON",
                   help="the rates (and the one-GPU layer's figures) of an earlier run on the GPU, "
                        "e.g. one with --only gpu1: with --replay, this machine replays the "
                        "modules at the rates that GPU measured")
    p.add_argument("--write-target-config", default=None, metavar="TXTPB",
                   help="write the local GPU's GpuTargetConfigProto text here and exit")
    return p.parse_args(argv)

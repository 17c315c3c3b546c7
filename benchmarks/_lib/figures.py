"""The named figures of the benchmark report: where each comes from and how it is printed.

Each figure BENCHMARKS.md's headline table, README.md or docs/ quote (``<!--fig:NAME-->``) is
one `Figure`, its target (where one was agreed) data, so that "met" is computed.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt,
        "within": lambda v, t: abs(v) <= t}


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure: ``name`` (what the markdown files quote it by), ``label`` (for the
    headline table), ``source`` (its current record, without ``.json``), ``get`` (the key of the
    value in its ``results``, or ``results -> value``), ``fmt`` (a ``str.format`` pattern),
    ``target`` (``"<op> <number>"``: ops ``>= <= < >``, and ``within`` for ``|value| <=``; or
    None) and ``headline`` (listed there)."""

    name: str
    label: str
    source: str
    get: str | Callable[[dict], Any]
    fmt: str = "{:.3f}"
    target: str | None = None
    headline: bool = True

    def value(self, results: dict) -> Any:
        return results[self.get] if isinstance(self.get, str) else self.get(results)

    def text(self, results: dict) -> str:
        return self.fmt.format(self.value(results))

    def target_text(self) -> str:
        """The target in the value's own format: ``>= 1.35x``, ``<= 15.0%``, ``within 1.00%``."""
        if self.target is None:
            return "-"
        op, number = self.target.split()
        return f"{op} {self.fmt.format(float(number)).lstrip('+')}"

    def met(self, results: dict) -> bool | None:
        """Whether the value meets the target (None without one)."""
        if self.target is None:
            return None
        op, number = self.target.split()
        if op not in _OPS:
            raise ValueError(f"Figure {self.name!r}: target op {op!r} is not one of {list(_OPS)}.")
        return _OPS[op](self.value(results), float(number))


def gmm_row(r: dict, kernel: str) -> dict:
    """The forward, balanced row of one grouped-GEMM kernel (records before gmm.py have no
    op or routing: their rows are those)."""
    return next(g for g in r["gmm"] if g["kernel"] == kernel and g.get("op", "fwd") == "fwd"
                and g.get("routing", "balanced") == "balanced")


def _layer_row(r: dict, transport: str, variant: str) -> dict:
    return next(e for e in r["layer"] if (e["transport"], e["variant"]) == (transport, variant))


def _dense_row(r: dict, shape: list[int], recipe: str) -> dict:
    return next(e for e in r["dense"] if e["shape"] == shape and e["recipe"] == recipe)


def _step(r: dict, variant: str) -> dict:
    return next(s for s in r["steps"] if s["variant"] == variant)


QKV, OUT = [65536, 2048, 6144], [65536, 2048, 2048]

FIGURES: tuple[Figure, ...] = (
    # Grouped GEMM and gated experts, one H200.
    Figure("gmm_fp8_over_triton_bf16", "FP8 grouped GEMM rate / bf16 Triton rate (gate_up, 32k "
           "rows)", "gmm", "fp8_gmm_over_bf16_rate", "{:.2f}", ">= 1.6", headline=False),
    Figure("gmm_mosaic_bf16_over_dense", "Mosaic bf16 grouped GEMM / dense bf16 rate",
           "gmm", lambda r: gmm_row(r, "mosaic_bf16")["tflops"] / r["dense_bf16_tflops"],
           "{:.2f}", headline=False),
    Figure("experts_fp8_ragged", "gated experts fwd+bwd, all GEMMs FP8 / bf16, ragged, balanced",
           "experts", "experts_fp8_speedup_ragged", "{:.2f}x", ">= 1.35"),
    Figure("experts_fp8_ragged_zipf", "the same, Zipf-skewed routing", "experts",
           "experts_fp8_speedup_ragged_zipf", "{:.2f}x", ">= 1.35"),
    Figure("experts_fp8_padded", "the same, padded [E, C, d] layout", "experts",
           "experts_fp8_speedup_padded", "{:.2f}x", ">= 1.35"),
    Figure("experts_fp8_lm_shape", "the same at the LM step's layer shape (131k rows, d 2048, d_ff "
           "1408)", "experts_lm_shapes", "experts_fp8_speedup_ragged", "{:.2f}x",
           headline=False),
    Figure("experts_fp8_worst_cos", "worst cosine of FP8 outputs and gradients against bf16",
           "experts", lambda r: min(e.get("worst_cos_vs_bf16", 1.0) for e in r["experts"]),
           "{:.4f}", ">= 0.99", headline=False),
    Figure("gmm_mosaic_fp8_tflops", "Mosaic FP8 grouped GEMM, TFLOP/s", "gmm",
           lambda r: gmm_row(r, "mosaic_fp8")["tflops"], "{:.0f}", headline=False),
    # The MoE layer on one GPU.
    Figure("layer_fp8_mfu_dropless", "MoE layer fwd+bwd MFU, FP8 dispatch + FP8 GEMMs, one GPU "
           "(dropless)", "fp8_layer", "moe_layer_fp8_mfu_1gpu_dropless", "{:.3f}", ">= 0.80"),
    Figure("layer_bf16_mfu_dropless", "the same layer in bf16", "fp8_layer",
           "moe_layer_bf16_mfu_1gpu_dropless", "{:.3f}", headline=False),
    Figure("layer_fp8_mfu_dense", "MoE layer MFU, FP8, one GPU, dense capacity 1.25",
           "experts", lambda r: _layer_row(r, "dense", "fp8")["mfu"], "{:.3f}", headline=False),
    Figure("layer_bf16_mfu_dense", "the same in bf16", "experts",
           lambda r: _layer_row(r, "dense", "bf16")["mfu"], "{:.3f}", headline=False),
    Figure("dropless_over_capacity", "dropless / capacity-1.25 layer time, one GPU, balanced",
           "dropless", "dropless_over_capacity_time_1gpu", "{:.3f}", "<= 1.15"),
    Figure("dropless_over_capacity_zipf", "the same, Zipf-skewed routing", "dropless",
           "dropless_over_capacity_time_1gpu_zipf", "{:.3f}", "< 1.0"),
    Figure("capacity_dropped_zipf", "slots capacity 1.25 drops under Zipf routing", "dropless",
           "capacity_dropped_frac_1gpu_zipf", "{:.1%}", headline=False),
    # FP8 dense projections.
    Figure("fp8_dense_qkv", "FP8 attention QKV projection fwd+bwd / bf16 (65536 x 2048 x "
           "6144, all GEMMs FP8)", "fp8_dense",
           lambda r: _dense_row(r, QKV, "all")["speedup_vs_bf16"], "{:.2f}x", headline=False),
    Figure("fp8_dense_out", "FP8 output projection (65536 x 2048 x 2048, FP8 forward + dgrad)",
           "fp8_dense", lambda r: _dense_row(r, OUT, "forward_dgrad")["speedup_vs_bf16"], "{:.2f}x",
           headline=False),
    Figure("fp8_dense_worst_cos", "worst cosine of the projections' FP8 outputs against bf16",
           "fp8_dense", lambda r: min(e.get("worst_cos_vs_bf16", 1.0) for e in r["dense"]),
           "{:.4f}", headline=False),
    # LM train step, one H200.
    Figure("lm_step_fp8_speedup", "LM train step, bf16 / FP8 time (FP8 wire, expert GEMMs, "
           "attention projections)", "lm_step", "lm_step_fp8_speedup", "{:.3f}x", ">= 1.2"),
    Figure("lm_step_bf16_ms", "LM step bf16, ms", "lm_step",
           lambda r: _step(r, "bf16")["step_ms"], "{:.1f}", headline=False),
    Figure("lm_step_fp8_ms", "LM step FP8, ms", "lm_step",
           lambda r: _step(r, "fp8_proj")["step_ms"], "{:.1f}", headline=False),
    Figure("lm_step_gemm_saving_ms", "GEMM kernel time FP8 saves per LM step, ms", "lm_step",
           lambda r: (_step(r, "bf16")["breakdown"]["us_per_step"]["gemm"]
                      - _step(r, "fp8_proj")["breakdown"]["us_per_step"]["gemm"]) / 1e3,
           "{:.1f}", headline=False),
    Figure("lm_step_gemm_bf16_ms", "GEMM kernel time per bf16 LM step, ms", "lm_step",
           lambda r: _step(r, "bf16")["breakdown"]["us_per_step"]["gemm"] / 1e3, "{:.1f}",
           headline=False),
    Figure("lm_step_gemm_fp8_ms", "GEMM kernel time per FP8 LM step, ms", "lm_step",
           lambda r: _step(r, "fp8_proj")["breakdown"]["us_per_step"]["gemm"] / 1e3, "{:.1f}",
           headline=False),
    # Loss parity.
    Figure("fp8_parity_gpu_fp8", "GPU preset, FP8 run's validation loss", "fp8_parity_gpu",
           "fp8_val_loss_300", "{:.4f}", headline=False),
    Figure("fp8_parity_gpu_bf16", "GPU preset, bf16 run's validation loss", "fp8_parity_gpu",
           "bf16_val_loss_300", "{:.4f}", headline=False),
    Figure("fp8_loss_gpu", "300-step validation loss, FP8 / bf16 - 1, GPU preset", "fp8_parity_gpu",
           "relative_difference", "{:+.2%}", "within 0.01"),
    Figure("fp8_loss_cpu", "the same, CPU preset (f32 compute), seed 0", "fp8_parity_cpu",
           "relative_difference", "{:+.2%}", "within 0.01"),
    Figure("fp8_loss_cpu_seed1", "the same, CPU preset, seed 1", "fp8_parity_cpu",
           lambda r: r["seed_1"]["relative_difference"], "{:+.2%}", headline=False),
    # Two GPUs.
    Figure("gmm_triton_over_dense", "Pallas Triton grouped GEMM / dense rate, balanced (2x H200 "
           "run)", "experts_2gpu", lambda r: r["grouped_gemm_by_routing"]["pallas/balanced"],
           "{:.3f}", headline=False),
    Figure("gmm_triton_over_dense_zipf", "the same, Zipf", "experts_2gpu",
           lambda r: r["grouped_gemm_by_routing"]["pallas/zipf"], "{:.3f}", headline=False),
    Figure("gmm_ragged_dot_over_dense", "XLA ragged_dot / dense rate", "experts_2gpu",
           lambda r: r["grouped_gemm_by_routing"]["ragged_dot/balanced"], "{:.3f}", headline=False),
    Figure("dispatch_fp8_over_bf16", "FP8 / bf16 dispatch time, EP=2, A/B", "dispatch_2gpu",
           "fp8_over_bf16_dispatch_time", "{:.3f}", "<= 0.6"),
    Figure("dispatch_combine_GBps", "dispatch + combine forward, GB/s per GPU (bf16)",
           "dispatch_2gpu", "dispatch_combine_GBps_per_gpu", "{:.0f}", ">= 150"),
    Figure("layer_mfu_ep2", "MoE layer fwd+bwd MFU, EP=2, bf16 dispatch", "moe_layer_2gpu",
           lambda r: r["moe_layer_mfu_by_variant"]["dense_einsum_bf16"], "{:.3f}", ">= 0.45"),
    Figure("muon_step_f32_s", "sharded Muon step, 1.6B f32 params, 2 GPUs, s", "muon_step_2gpu",
           "muon_step_seconds", "{:.3f}", headline=False),
    Figure("muon_over_limit", "sharded Muon step / compute + all-reduce limit (f32 params)",
           "muon_step_2gpu", "muon_step_over_limit", "{:.2f}x", "<= 1.3"),
    Figure("muon_vs_optax", "optax.contrib.muon step / sharded Muon step, f32 params",
           "muon_step_2gpu", "muon_step_speedup_vs_optax", "{:.2f}x", ">= 3"),
    Figure("muon_vs_optax_bf16", "the same with bf16 params", "muon_step_2gpu",
           "bf16_params_muon_step_speedup_vs_optax", "{:.2f}x"),
    Figure("muon_symmetric_speedup", "Muon update on one GPU, 1.62B f32 params: 4 row strips of "
           "the symmetric products / plain matmuls", "muon_step_1gpu",
           "symmetric_over_plain_update", "{:.3f}x", headline=False),
    Figure("muon_auto_speedup", "Muon update on one GPU, 1.62B f32 params: the Hopper "
           "defaults (symmetric-tile kernel; Gram form on wide banks) / plain matmuls",
           "muon_speed", lambda r: r["muon_step"]["auto"]["update_s"]
           / r["muon_step"]["standard"]["update_s"], "{:.3f}x", headline=False),
    Figure("muon_ns_vs_54b8671", "Muon update on one GPU, 1.62B f32 params, Hopper defaults / "
           "0.2905 s (one H200, tree 54b8671)", "muon_speed", "ns_time_ratio_vs_54b8671", "{:.3f}x",
           "<= 0.7"),
    Figure("muon_over_adamw_step", "trainer GPU preset: Muon step / AdamW step", "muon_speed",
           "muon_over_adamw_step_time", "{:.2f}x", headline=False),
    Figure("muon_race_fraction", "trainer GPU preset: Muon's time to AdamW's final loss / AdamW's "
           "time", "muon_speed", "muon_time_to_adamw_final_loss_fraction", "{:.2f}x", "<= 0.5"),
    # Compiled 8-GPU schedules.
    Figure("sched_moe_ep8", "MoE layer EP=8, exposed communication (compiled schedule, defaults: "
           "dense, 2 chunks)", "schedule8", "moe_ep8_exposed_fraction", "{:.1%}", "<= 0.15"),
    Figure("sched_moe_ep8_dropless", "the same, dropless (2 chunks)", "schedule8",
           "moe_ep8_dropless_exposed_fraction", "{:.1%}", "<= 0.15"),
    Figure("sched_moe_ep8_dropless_unchunked", "the dropless layer EP=8, unchunked", "schedule8",
           "moe_ep8_dropless_unchunked_exposed_fraction", "{:.1%}", headline=False),
    Figure("sched_train_ep8", "trainer's GPU-preset step, mesh (1, 8), exposed (as its --pgle runs "
           "it: 4 chunks)", "schedule8", "train_step_ep8_exposed_fraction", "{:.1%}", "<= 0.20"),
    Figure("sched_train_ep8_xla", "the same compiled on XLA's own latency estimates", "schedule8",
           "train_step_ep8_exposed_fraction_xla_estimates", "{:.1%}", headline=False),
    Figure("sched_train_dp8", "trainer's GPU-preset step, data parallel (8, 1), 64 x 1024 tokens "
           "per GPU, Muon: exposed", "schedule8", "train_step_dp8_exposed_fraction", "{:.1%}",
           "<= 0.10"),
    Figure("sched_train_dp8_muon_over_adamw", "the same: Muon's step / AdamW's (predicted)",
           "schedule8", "train_step_dp8_muon_over_adamw_step", "{:.3f}x", "<= 1.05"),
    Figure("sched_train_4x2", "the same on mesh (4, 2), Muon: exposed", "schedule8",
           "train_step_4x2_exposed_fraction", "{:.1%}", "<= 0.10"),
    Figure("sched_muon_dp8", "sharded Muon's synthetic step, 8 GPUs, exposed (defaults)",
           "schedule8", "muon_dp8_exposed_fraction", "{:.1%}", headline=False),
    Figure("sched_muon_dp8_over_floor", "sharded Muon's synthetic step, 8 GPUs: exposed - the "
           "least any order exposes", "schedule8", "muon_dp8_exposed_over_floor", "{:.1%}",
           "<= 0.05"),
    Figure("sched_muon_dp8_chunked", "the same with chunk_bytes=1", "schedule8",
           "muon_dp8_chunked_exposed_fraction", "{:.1%}", headline=False),
    Figure("sched_muon_dp8_floor", "the least any order of that step's work exposes (collectives - "
           "compute, over collectives)", "schedule8", "muon_dp8_exposed_floor", "{:.1%}",
           headline=False),
    Figure("sched_moe_ep64", "MoE layer over 64 GPUs (8 hosts), A's per-device work, 2 chunks",
           "schedule8", "moe_ep64_exposed_fraction", "{:.1%}", headline=False),
    Figure("chunked_over_unchunked_1gpu", "the layer in 2 chunks / unchunked, time on one GPU",
           "schedule8", "chunked_over_unchunked_1gpu", "{:.3f}x", "<= 1.05", headline=False),
    # The trainer.
    Figure("main_job_muon", "README main job (CPU preset, 300 steps): Muon validation loss",
           "train_lm_cpu", lambda r: r["results"]["muon"]["final_val_loss"], "{:.4f}"),
    Figure("main_job_adamw", "the same, AdamW", "train_lm_cpu",
           lambda r: r["results"]["adamw"]["final_val_loss"], "{:.4f}"),
    Figure("main_job_muon_bits", "Muon, bits/byte", "train_lm_cpu",
           lambda r: r["results"]["muon"]["final_val_bits_per_byte"], "{:.4f}", headline=False),
    Figure("main_job_adamw_bits", "AdamW, bits/byte", "train_lm_cpu",
           lambda r: r["results"]["adamw"]["final_val_bits_per_byte"], "{:.4f}", headline=False),
    Figure("main_job_gap", "AdamW - Muon validation loss", "train_lm_cpu",
           lambda r: r["results"]["adamw"]["final_val_loss"]
           - r["results"]["muon"]["final_val_loss"], "{:.3f}", headline=False),
    Figure("main_job_wall", "the main job's wall time", "train_lm_cpu",
           lambda r: divmod(round(r["wall_s_total"]), 60), "{0[0]} min {0[1]} s", headline=False),
    Figure("main_job_muon_s", "Muon run, s", "train_lm_cpu",
           lambda r: r["results"]["muon"]["wall_s"], "{:.0f}", headline=False),
    Figure("main_job_adamw_s", "AdamW run, s", "train_lm_cpu",
           lambda r: r["results"]["adamw"]["wall_s"], "{:.0f}", headline=False),
    Figure("sweep_gap_cpu", "AdamW's best - Muon's default, 300-step sweep, CPU preset",
           "lr_sweep_cpu", lambda r: -r["cpu_muon_default_minus_adamw_best"], "{:.3f}"),
    Figure("sweep_gap_gpu", "the same, GPU preset (one H200)", "lr_sweep_gpu",
           lambda r: -r["gpu_muon_default_minus_adamw_best"], "{:.3f}", headline=False),
    Figure("muon_gather_bf16_delta", "bf16 - f32 Muon update gathers, validation loss (CPU preset, "
           "mean of 3 seeds)", "muon_gather_dtype", "delta_bf16_minus_f32", "{:+.4f}",
           headline=False),
    Figure("eager_over_jit", "eager MoE layer call / jitted call (CPU)", "eager_layer",
           "eager_over_jit", "{:.2f}x", "<= 3", headline=False),
    # The peer comparison (benchmarks/vs_transformers.py).
    Figure("vs_hf_bf16_qwen3", "MoE layer fwd+bwd, bf16: the faster transformers block "
           "(grouped_mm, eager or compiled) / moe, Qwen3-30B-A3B shape", "layer_vs_transformers",
           "bf16_over_best_hf_qwen3_30b_a3b", "{:.2f}x", ">= 1.15"),
    Figure("vs_hf_fp8_qwen3", "the same, moe in FP8", "layer_vs_transformers",
           "fp8_over_best_hf_qwen3_30b_a3b", "{:.2f}x", ">= 1.3"),
    Figure("vs_hf_bf16_mixtral", "the same in bf16, Mixtral-8x7B shape", "layer_vs_transformers",
           "bf16_over_best_hf_mixtral_8x7b", "{:.2f}x", ">= 1.15"),
    # The house (kernel layer, registry, options resolved once).
    Figure("house_ab_max", "the house: after / before - 1 of the layer, experts, Muon and LM "
           "step times, the furthest from 0", "house_ab", lambda r: max(
               (c["new_over_base"] - 1 for p in r["pairs"].values()
                for c in p["cases"].values()), key=abs), "{:+.3f}", "within 0.03"),
)

BY_NAME = {f.name: f for f in FIGURES}

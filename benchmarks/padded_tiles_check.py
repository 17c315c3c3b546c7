"""GPU check: padded x with under-filled experts on 'mosaic' (tiles past the filled slots skipped)
against the 'einsum' backend, bf16 and all-FP8.

`moe.gated_experts` runs padded ``x [E, C, d]`` on the Mosaic GPU kernels with every expert's
``C`` slots as rows and skips the row tiles past ``group_sizes[e]``
(``accel_kernels.gmm.api.RowGroups``).
The tests check the tile maps on the CPU, where the kernels do not run; this script runs them:
group sizes from full to empty (0, 1, 128, C - 1, C, ...), y and the three gradients of
``sum(y * ct)`` against the einsum backend of the same precision (expected: equal up to f32
summation order) and against einsum bf16 (the FP8 error bar: cosine >= 0.996, relative RMS <=
0.09), and y and dx exactly zero on the empty slots.

Usage:
  python benchmarks/padded_tiles_check.py --out r.json    # one Hopper GPU
  python benchmarks/padded_tiles_check.py --small         # CPU plumbing (the kernels' XLA
                                                          # emulation: no tiles are skipped)
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_util import cli, env_info, experts_step, leaf_errors, write_json  # noqa: E402

DESCRIPTION = """\
GPU check of padded x [E, C, d] with under-filled experts on the 'mosaic' backend (row tiles
past each expert's group size skipped): y and the three gradients against 'einsum' (same
recipe; and bf16: cosine >= 0.996, relative RMS <= 0.09), bf16 and all-FP8, and y, dx zero on
the empty slots. Shape 8 experts x 1280 slots, d 1024, d_ff 512 (--small: 200, 128, 64 on
CPU). JSON (--out): recipes (per recipe errors and ok), group_sizes, ok; exit 1 if not ok."""


ALL_FP8 = dict(gemm_dtype="fp8", dgrad_dtype="fp8", wgrad_dtype="fp8")


def _inputs(e, c, d, f):
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (e, c, d), jnp.bfloat16)
    wgu = (jax.random.normal(k[1], (e, d, 2 * f)) * d ** -0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(k[2], (e, f, d)) * f ** -0.5).astype(jnp.bfloat16)
    ct = jax.random.normal(k[3], (e, c, d), jnp.bfloat16)
    return x, wgu, wd, ct


def _step(backend, gs, opts):
    return experts_step(backend, gs, **opts)


def _errors(got, ref) -> list[dict]:
    return [{"tensor": name, "cos": cos, "rel_rms": rel} for name, (cos, rel) in
            zip(("y", "dx", "dw_gate_up", "dw_down"), leaf_errors(got, ref), strict=True)]


def main(argv=None) -> dict:
    p = cli(DESCRIPTION)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    e, c, d, f = (8, 200, 128, 64) if a.small else (8, 1280, 1024, 512)
    sizes = np.array([c, c - 256, c // 2 + 60, 0, 1, 128, c - 1, c // 2 - 40], np.int32)
    x, wgu, wd, ct = _inputs(e, c, d, f)
    gs = jnp.asarray(sizes)
    empty = jnp.asarray(np.arange(c)[None, :] >= sizes[:, None])[..., None]
    report = {"benchmark": "padded_tiles_check", "env": env_info(), "shape": [e, c, d, f],
              "group_sizes": sizes.tolist(), "recipes": {}}
    ref_bf16 = _step("einsum", gs, {})(x, wgu, wd, ct)
    for recipe, opts in (("bf16", {}), ("fp8_all", ALL_FP8)):
        got = _step("mosaic", gs, opts)(x, wgu, wd, ct)
        same = ref_bf16 if recipe == "bf16" else _step("einsum", gs, opts)(x, wgu, wd, ct)
        row = {"vs_einsum_same_recipe": _errors(got, same),
               "vs_einsum_bf16": _errors(got, ref_bf16),
               "empty_slots_y_absmax": float(jnp.max(jnp.abs(jnp.where(empty, got[0], 0)))),
               "empty_slots_dx_absmax": float(jnp.max(jnp.abs(jnp.where(empty, got[1], 0))))}
        same_worst = max(r["rel_rms"] for r in row["vs_einsum_same_recipe"])
        bar = max(r["rel_rms"] for r in row["vs_einsum_bf16"])
        cos = min(r["cos"] for r in row["vs_einsum_bf16"])
        row["ok"] = bool(same_worst < 1e-3 and bar <= 0.09 and cos >= 0.996
                         and row["empty_slots_y_absmax"] == 0.0
                         and row["empty_slots_dx_absmax"] == 0.0)
        report["recipes"][recipe] = row
        print(f"{recipe:8s} vs einsum same recipe: worst rel RMS {same_worst:.2e};  vs einsum "
              f"bf16: worst cos {cos:.4f}, rel RMS {bar:.4f};  empty slots y/dx max "
              f"{row['empty_slots_y_absmax']}/{row['empty_slots_dx_absmax']};  "
              f"{'ok' if row['ok'] else 'FAILED'}", flush=True)
    report["ok"] = all(r["ok"] for r in report["recipes"].values())
    write_json(a.out, report)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)

"""What every section of BENCHMARKS.md uses: markdown tables, quoted figures, and the line
that says where a section's figures come from."""

from __future__ import annotations

from report_figures import BY_NAME

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
    """The line saying where a section's figures come from."""
    r = C[name]
    sw = r["software"]
    note = f" Note: {r['note']}." if r.get("note") else ""
    return [f"Source: [`current/{name}.json`](benchmarks/results/current/{name}.json), "
            f"{r['hardware']}, jax {sw['jax']}, Python {sw['python']}, commit `{r['commit']}`, "
            f"{r['date']}; {ceiling_text(r['ceiling'])}. Command: `{r['command']}`"
            + (f" (the scripts since merged: `{r['rerun']}`)" if r.get("rerun") else "")
            + f".{note}"]


def x(v: float, d: int = 2) -> str:
    return f"{v:.{d}f}x"


def ms(v: float, d: int = 2) -> str:
    return f"{v:.{d}f}"

"""Plot a run_gpu.sh output directory: achieved vs ceiling bars, one PNG per benchmark.

Reads OUT/h200x2.json (benchmarks/collect.py) and the per-script JSONs next to it; writes
OUT/plot_*.png with matplotlib, or OUT/plot_*.svg (no dependency) where matplotlib is not
installed. Runs anywhere: ``python benchmarks/plot_results.py OUT`` (e.g. locally on the
fetched results).
"""

from __future__ import annotations

import argparse
import json
import math
from html import escape
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _num(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _svg_bars(path: Path, title, labels, values, ylabel, ref, ref_label, notes):
    w, h, left, bottom, top = max(480, 70 * len(labels) + 120), 420, 70, 130, 40
    vmax = max([v for v in values if _num(v)] + ([ref] if _num(ref) else []) + [1e-12]) * 1.1
    plot_h, plot_w = h - bottom - top, w - left - 20
    bw = plot_w / max(len(labels), 1)
    y = lambda v: top + plot_h * (1 - v / vmax)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<text x="14" y="{top + plot_h / 2}" transform="rotate(-90 14 {top + plot_h / 2})" '
           f'text-anchor="middle">{escape(ylabel)}</text>',
           f'<line x1="{left}" y1="{top + plot_h}" x2="{w - 20}" y2="{top + plot_h}" '
           'stroke="black"/>']
    for i, (lab, v) in enumerate(zip(labels, values, strict=True)):
        x = left + i * bw + bw * 0.15
        cx = left + (i + 0.5) * bw
        if _num(v):
            out.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bw * 0.7:.1f}" '
                       f'height="{top + plot_h - y(v):.1f}" fill="#4477aa"/>')
            out.append(f'<text x="{cx:.1f}" y="{y(v) - 3:.1f}" text-anchor="middle">'
                       f'{v:.3g}</text>')
        else:
            out.append(f'<text x="{cx:.1f}" y="{top + plot_h - 3}" text-anchor="middle">n/a</text>')
        out.append(f'<text x="{cx:.1f}" y="{top + plot_h + 12}" text-anchor="end" '
                   f'transform="rotate(-40 {cx:.1f} {top + plot_h + 12})">{escape(lab)}</text>')
    if _num(ref):
        out.append(f'<line x1="{left}" y1="{y(ref):.1f}" x2="{w - 20}" y2="{y(ref):.1f}" '
                   'stroke="#cc3311" stroke-dasharray="5,3"/>')
        out.append(f'<text x="{w - 22}" y="{y(ref) - 4:.1f}" text-anchor="end" fill="#cc3311">'
                   f'{escape(ref_label or "")} {ref:.3g}</text>')
    for j, n in enumerate(notes or []):
        out.append(f'<text x="{left}" y="{h - 8 - 13 * j}">{escape(n)}</text>')
    out.append("</svg>")
    path = path.with_suffix(".svg")
    path.write_text("\n".join(out))
    return path


def bars(path: Path, title, labels, values, ylabel, ref=None, ref_label=None, notes=None):
    """One bar chart; PNG via matplotlib, else SVG. Returns the written path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _svg_bars(path, title, labels, values, ylabel, ref, ref_label, notes)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) + 2), 4.6))
    vals = [v if _num(v) else 0.0 for v in values]
    rects = ax.bar(range(len(labels)), vals, color="#4477aa")
    for r, v in zip(rects, values, strict=True):
        ax.annotate(f"{v:.3g}" if _num(v) else "n/a", (r.get_x() + r.get_width() / 2,
                    r.get_height()), ha="center", va="bottom", fontsize=8)
    if _num(ref):
        ax.axhline(ref, color="#cc3311", ls="--", label=f"{ref_label} {ref:.3g}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    for j, n in enumerate(notes or []):
        fig.text(0.01, 0.01 + 0.035 * j, n, fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.04 * len(notes or []), 1, 1))
    path = path.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(out: Path) -> list[Path]:
    s = _load(out / "h200x2.json") or {}
    env = s.get("env") or {}
    tag = f"{env.get('n_devices', '?')}x {env.get('device_kind', '?')}, jax {env.get('jax', '?')}"
    ceiling = s.get("dense_bf16_matmul_tflops")
    written = []

    # 1. every benchmark as a fraction of its ceiling
    labels, vals = [], []
    eb = _load(out / "experts_bench.json")
    if eb:
        for r in eb.get("results", []):
            if r.get("routing") == "balanced" and r.get("config") == "bf16":
                labels.append(f"grouped GEMM {r['backend']}")
                vals.append(r.get("ratio_to_dense"))
    for k, v in (s.get("moe_layer_mfu_by_variant") or {}).items():
        labels.append(f"MoE layer {k}")
        vals.append(v)
    for k, v in (s.get("lm_step_by_variant") or {}).items():
        labels.append(f"LM step {k}")
        vals.append(v.get("mfu"))
    if _num(s.get("muon_step_over_limit")) and s["muon_step_over_limit"] > 0:
        labels.append("Muon step (limit / time)")
        vals.append(1.0 / s["muon_step_over_limit"])
    if labels:
        written.append(bars(out / "plot_ceiling_ratios", f"Achieved / ceiling ({tag})", labels,
                            vals, "fraction of measured ceiling", 1.0, "ceiling",
                            [f"ceiling: dense bf16 matmul {ceiling:.3g} TFLOP/s per device"
                             if _num(ceiling) else "ceiling: not measured"]))

    # 2. grouped GEMMs: useful TFLOP/s vs dense
    if eb and eb.get("results"):
        rs = eb["results"]
        written.append(bars(
            out / "plot_experts_bench", f"gated_experts fwd+bwd useful TFLOP/s ({tag})",
            [f"{r['routing']}/{r['backend']}/{r['config']}" for r in rs],
            [r.get("useful_tflops") for r in rs], "TFLOP/s", eb.get("dense", {}).get("tflops"),
            "dense same shape"))

    # 3. MoE layer
    ml = _load(out / "moe_layer_bench.json")
    if ml and ml.get("layer"):
        rs = ml["layer"]
        notes = [f"{r['variant']}: dropped {r['dropped_frac']:.4f}"
                 + (f", exposed comm {r['overlap']['exposed_fraction']:.3f}"
                    if _num((r.get("overlap") or {}).get("exposed_fraction")) else "")
                 for r in rs]
        written.append(bars(
            out / "plot_moe_layer", f"MoE layer fwd+bwd useful TFLOP/s per device ({tag})",
            [r["variant"] for r in rs], [r["useful_tflops_per_device"] for r in rs],
            "TFLOP/s per device", ml.get("ceiling", {}).get("tflops"), "dense bf16", notes))

    # 4. dispatch + combine
    dc = _load(out / "dispatch_check.json")
    labels, vals = [], []
    for kernels, r in ((dc or {}).get("dispatch_ab") or {}).items():
        labels += [f"dispatch bf16 (A/B, {kernels})", f"dispatch fp8 (A/B, {kernels})"]
        vals += [r.get("bf16_ms"), r.get("fp8_ms")]
    for r in (dc or {}).get("timings", []):
        labels += [f"{r['transport']}/{r['wire']} fwd", f"{r['transport']}/{r['wire']} fwd+bwd"]
        vals += [r.get("fwd_ms"), r.get("fwd_bwd_ms")]
    if labels:
        written.append(bars(out / "plot_dispatch_ms", f"dispatch / dispatch+combine ({tag})",
                            labels, vals, "ms (lower is better)"))
    labels, vals = [], []
    for r in (ml or {}).get("dispatch_combine") or []:
        labels.append(f"dense/{r['wire']}, identity experts")
        vals.append(r["GBps_per_gpu"])
    for r in (_load(out / "dispatch_phases.json") or {}).get("phases", []):
        if r.get("phase") == "dispatch+combine fwd (expert_x materialized)":
            labels.append(f"dense/{r['wire']}, expert_x materialized")
            vals.append(r.get("GBps_remote"))
    if labels:
        written.append(bars(
            out / "plot_dispatch_GBps", f"dispatch+combine all-to-all GB/s per GPU ({tag})",
            labels, vals, "GB/s per GPU (bytes sent / fwd time)", 150.0, "target 150"))

    # 5. LM step
    lm = _load(out / "lm_step_bench.json")
    if lm and lm.get("steps"):
        rs = lm["steps"]
        written.append(bars(
            out / "plot_lm_step", f"LM train step: MFU ({tag})", [r["variant"] for r in rs],
            [r["mfu"] for r in rs], "MFU (vs measured dense bf16)", 1.0, "ceiling",
            [f"{r['variant']}: {r['step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s"
             for r in rs]))
    return written



DESCRIPTION = """\
Plots a benchmarks/run_gpu.sh output directory OUT (h200x2.json from benchmarks/collect.py and
the per-run JSONs next to it), measuring nothing: achieved vs ceiling bars per benchmark.
Writes OUT/plot_{ceiling_ratios,experts_bench,moe_layer,dispatch_ms,dispatch_GBps,lm_step}.png
(matplotlib), or .svg where matplotlib is not installed."""


def main(argv=None):
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the run_gpu.sh output directory")
    a = p.parse_args(argv)
    written = plot_all(Path(a.out))
    for w in written:
        print(f"wrote {w}")
    if not written:
        print(f"nothing to plot under {a.out}")


if __name__ == "__main__":
    main()

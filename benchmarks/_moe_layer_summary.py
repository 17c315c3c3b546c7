"""The summary and the printed table of benchmarks/moe_layer_bench.py's report (a library,
no command line)."""

from __future__ import annotations

from xla_comm.breakdown import format_table


def dropless_summary(report, *, capacity: str, dropless: str, ragged: str,
                     routings: tuple[str, ...]) -> dict:
    """Issue 14's ratios from this run (see benchmarks/moe_layer_bench.py's docstring): the
    ``dropless`` and ``ragged`` layer variants over the ``capacity`` one, per routing."""
    e = report["env"]
    n = e["n_devices"]
    tag = f"{n}gpu" if e["backend"] in ("gpu", "cuda", "rocm") else f"{n}{e['backend']}"
    by = {r["variant"]: r for r in report["layer"]}
    dc = {(r["transport"], r["wire"], r["routing"]): r
          for r in report.get("dispatch_combine", [])}
    out: dict = {"n_devices": n, "device_kind": e["device_kind"], "tag": tag,
                 "capacity_variant": capacity, "dropless_variant": dropless,
                 "ragged_variant": ragged, "capacity_factor": report["settings"][
                     "capacity_factor"]}
    for routing in routings:
        sfx = "" if routing == "balanced" else f"_{routing}"
        cap = by.get(capacity + sfx)
        ab = report.get("layer_ab", {}).get(routing, {}).get("over_capacity", {})
        for key, name in (("dropless", dropless), ("ragged", ragged)):
            row = by.get(name + sfx)
            if cap and row:
                # interleaved A/B when it ran, else the separately timed medians
                out[f"{key}_over_capacity_time_{tag}{sfx}"] = ab.get(name, row["ms"] / cap["ms"])
                out[f"{key}_over_capacity_time_separate_runs_{tag}{sfx}"] = row["ms"] / cap["ms"]
                out[f"{key}_layer_ms_{tag}{sfx}"] = row["ms"]
                out[f"{key}_layer_mfu_{tag}{sfx}"] = row["mfu"]
                out[f"{key}_dropped_slots_{tag}{sfx}"] = row["dropped_slots"]
        if cap:
            out[f"capacity_layer_ms_{tag}{sfx}"] = cap["ms"]
            out[f"capacity_layer_mfu_{tag}{sfx}"] = cap["mfu"]
            out[f"capacity_dropped_frac_{tag}{sfx}"] = cap["dropped_frac"]
        dense, drop = dc.get(("dense", "bf16", routing)), dc.get(("dropless", "bf16", routing))
        ab = report.get("dispatch_combine_ab", {}).get(routing)
        if ab:  # interleaved A/B: robust to drift between separately timed runs
            out[f"dropless_dispatch_combine_over_dense_{tag}{sfx}"] = ab["ratio_of_medians"]
        elif dense and drop:
            out[f"dropless_dispatch_combine_over_dense_{tag}{sfx}"] = (
                drop["fwd_bwd_ms"] / dense["fwd_bwd_ms"])
        if dense and drop:
            out[f"dropless_dispatch_combine_separate_runs_over_dense_{tag}{sfx}"] = (
                drop["fwd_bwd_ms"] / dense["fwd_bwd_ms"])
            out[f"dropless_dispatch_combine_fwd_over_dense_{tag}{sfx}"] = (
                drop["fwd_ms"] / dense["fwd_ms"])
    targets = {f"dropless_over_capacity_time_{tag}": ("<=", 1.15),
               f"dropless_over_capacity_time_{tag}_zipf": ("<", 1.0),
               f"dropless_dispatch_combine_over_dense_{tag}": ("<=", 1.3),
               f"dropless_layer_mfu_{tag}": (">=", 0.50)}
    out["targets"] = {k: f"{op} {v}" for k, (op, v) in targets.items()}
    out["met"] = {k: (out[k] <= v if op == "<=" else out[k] < v if op == "<" else out[k] >= v)
                  for k, (op, v) in targets.items() if k in out}
    return out


def print_table(report):
    c = report["ceiling"]
    e = report["env"]
    s = report["settings"]
    print(f"\nMoE layer fwd+bwd on {e['n_devices']}x {e['device_kind']} ({e['backend']}), jax "
          f"{e['jax']}: tokens/device {s['tokens']}, d_model {s['d_model']}, d_ff {s['d_ff']}, "
          f"E {s['experts']}, top-{s['top_k']}")
    print(f"dense bf16 ceiling {c['tflops']:.2f} TFLOP/s per device ({c['name']})")
    hdr = f"{'variant':32s} {'ms':>9s} {'TFLOP/s/dev':>11s} {'MFU':>7s} {'dropped':>8s} " \
          f"{'exposed':>8s}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in report["layer"]:
        ov = (r.get("overlap") or {}).get("exposed_fraction")
        print(f"{r['variant']:32s} {r['ms']:9.3f} {r['useful_tflops_per_device']:11.3f} "
              f"{r['mfu']:7.3f} {r['dropped_frac']:8.4f} "
              f"{'-' if ov is None else f'{ov:.3f}':>8s}")
    for r in report.get("dispatch_combine", []):
        print(f"dispatch+combine {r['transport']:8s} {r['wire']:4s} {r['routing']:8s}: fwd "
              f"{r['fwd_ms']:8.3f} ms, fwd+bwd {r['fwd_bwd_ms']:8.3f} ms, "
              f"{r['sent_mb_per_device']:8.2f} MB sent/dev, {r['GBps_per_gpu']:8.2f} GB/s/GPU")
    bds = {r["variant"]: r["breakdown"] for r in report["layer"]
           if isinstance(r.get("breakdown"), dict) and "us_per_step" in r["breakdown"]}
    if bds:
        print("\nop breakdown per step (summed over devices; jax.profiler trace, "
              "xla_comm.breakdown):")
        print(format_table(bds))
    print("\ndropless summary:")
    for k, v in report.get("dropless", {}).items():
        print(f"  {k}: {v}")

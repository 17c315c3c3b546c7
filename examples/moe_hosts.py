"""The MoE layer's exchange past one host, one stage against two, on a ('host', 'expert') mesh.

One process per host joins the others (``jax.distributed``: ``--coordinator-address``, or a
launcher jax recognizes: SLURM, Open MPI, a Kubernetes indexed Job), the devices are laid out
host-major (mesh axis ``'host'`` over the processes, ``'expert'`` over each one's devices),
and the layer's forward and backward pass (with its output used: ``0.5 sum(y^2 ct)``) run
with ``host_axis=None`` (every slot crosses on its own) and ``host_axis='host'`` (each token
once per host, then within it; what ``'auto'`` picks here when the first stage sends fewer
bytes across hosts). It checks that both give the same outputs and gradients, then times them
in interleaved rounds and prints, per exchange, the median step and the all-to-alls' bytes
per device addressed to other hosts (read from the compiled program, ``xla_comm.schedule``).

DeepSeek-V3's per-device work over 8 hosts of 8 GPUs (256 experts in 8 host groups, top-8
within 4 of them; 8192 tokens per GPU, d 7168, d_ff 2048, FP8 wires)::

    srun --nodes 8 --ntasks-per-node 1 --gpus-per-task 8 \\
        python3 examples/moe_hosts.py --preset deepseek-v3

On one machine (8 simulated CPU devices as 2 "hosts" of 4 in one process: the values, and
the bytes, not the links' speed)::

    python3 examples/moe_hosts.py --hosts 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Before JAX initializes: 8 CPU devices for a CPU run (unused where an accelerator is the
# default backend).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from lm_cluster import add_process_flags, init_distributed, process_flags_error  # noqa: E402

import moe  # noqa: E402
from xla_comm import schedule  # noqa: E402

AXES = ("host", "expert")
PRESETS = {
    # tokens per device, d_model, d_ff, experts, top_k, groups, topk_groups, chunks, fp8
    "small": dict(tokens=64, d_model=64, d_ff=32, experts=16, top_k=4, groups=2,
                  topk_groups=1, chunks=2, fp8=True, dtype="float32"),
    "deepseek-v3": dict(tokens=8192, d_model=7168, d_ff=2048, experts=256, top_k=8, groups=8,
                        topk_groups=4, chunks=2, fp8=True, dtype="bfloat16"),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--preset", choices=sorted(PRESETS), default="small")
    add("--hosts", type=int, default=None,
        help="size of the 'host' axis (default: the process count, or 2 in one process)")
    for name, kind in (("tokens", int), ("d-model", int), ("d-ff", int), ("experts", int),
                       ("top-k", int), ("groups", int), ("topk-groups", int), ("chunks", int)):
        add(f"--{name}", type=kind, default=None, help="overrides the preset")
    add("--fp8", action=argparse.BooleanOptionalAction, default=None,
        help="FP8 dispatch and combine-gradient wires (default: the preset's)")
    add("--dtype", choices=("float32", "bfloat16"), default=None)
    add("--rounds", type=int, default=5, help="interleaved timing rounds")
    add("--out", default=None, help="also write the figures here (JSON)")
    add_process_flags(p)
    a = p.parse_args(argv)
    if (error := process_flags_error(a)) is not None:
        p.error(error)
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


def host_mesh(hosts: int) -> jax.sharding.Mesh:
    """``(hosts, devices per host)`` over every process's devices, host-major: with one
    process per host, the ``'host'`` axis runs over the processes."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if hosts < 1 or len(devices) % hosts:
        raise SystemExit(f"moe_hosts.py: error: --hosts {hosts} must divide the "
                         f"{len(devices)} devices.")
    grid = np.array(devices).reshape(hosts, len(devices) // hosts)
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def options(a: argparse.Namespace, host_axis: str | None) -> moe.MoEOptions:
    wire = "fp8" if a.fp8 else "bf16"
    return moe.MoEOptions.create(
        a.experts, a.top_k, expert_axis=AXES, host_axis=host_axis, transport="dense",
        overlap_chunks=a.chunks, dispatch_dtype=wire, combine_grad_dtype=wire,
        num_groups=a.groups, topk_groups=a.topk_groups, fp8_block_size=min(128, a.d_model))


def inputs(a: argparse.Namespace, mesh: jax.sharding.Mesh):
    """Tokens ``[devices, tokens, d]`` split over both axes, the router replicated, the
    expert banks split by expert, and the loss's weights; made where they live."""
    n, dt = mesh.devices.size, jnp.dtype(a.dtype)
    rows = NamedSharding(mesh, P(AXES))
    shardings = (rows, NamedSharding(mesh, P()), rows, rows, rows)

    def make(key):
        k = jax.random.split(key, 5)
        return (jax.random.normal(k[0], (n, a.tokens, a.d_model), dt),
                jax.random.normal(k[1], (a.d_model, a.experts), jnp.float32),
                (jax.random.normal(k[2], (a.experts, a.d_model, 2 * a.d_ff), jnp.float32)
                 * a.d_model ** -0.5).astype(dt),
                (jax.random.normal(k[3], (a.experts, a.d_ff, a.d_model), jnp.float32)
                 * a.d_ff ** -0.5).astype(dt),
                jax.random.normal(k[4], (n, a.tokens, a.d_model), jnp.float32))

    return jax.jit(make, out_shardings=shardings)(jax.random.key(0))


def step_fn(opts: moe.MoEOptions, mesh: jax.sharding.Mesh):
    """The layer's loss (its output used, as a next layer uses it) and every gradient."""

    def loss(x, router, wgu, wd, ct):
        y, aux = moe.moe_apply(x, router, wgu, wd, options=opts, mesh=mesh)
        y32 = y.astype(jnp.float32)
        return 0.5 * jnp.sum(y32 * y32 * ct) + 0.01 * aux["load_balance_loss"], y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def cross_host_bytes(compiled, mesh: jax.sharding.Mesh) -> float:
    """The all-to-alls' bytes per device and step addressed to other hosts (the link rates
    play no part in this count)."""
    hw = schedule.Hardware(gemm_tflops=1.0, fp8_gemm_tflops=1.0, hbm_GBps=1.0, link_GBps=1.0,
                           inter_host_GBps=1.0, devices_per_host=mesh.shape["expert"])
    return schedule.schedule_report(compiled, hw).summary(("all-to-all",))["cross_host_bytes"]


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    how = init_distributed(a)
    hosts = a.hosts or (jax.process_count() if jax.process_count() > 1 else 2)
    mesh = host_mesh(hosts)
    args = inputs(a, mesh)
    lead = jax.process_index() == 0
    if lead:
        print(f"{jax.process_count()} process(es){f' ({how})' if how else ''}, mesh "
              f"{dict(mesh.shape)} of {jax.devices()[0].device_kind}; {a.experts} experts, "
              f"top-{a.top_k} within {a.topk_groups} of {a.groups} groups, {a.tokens} tokens "
              f"x d {a.d_model} per device, d_ff {a.d_ff}, {a.chunks} chunks, "
              f"{'FP8' if a.fp8 else 'bf16'} wires, {a.dtype}", flush=True)
    fns = {}
    for name, axis in (("one-stage", None), ("two-stage", "host")):
        fns[name] = step_fn(options(a, axis), mesh).lower(*args).compile()
    outs = {name: jax.block_until_ready(f(*args)) for name, f in fns.items()}
    tol = 1e-5 if a.dtype == "float32" and not a.fp8 else (1e-4 if a.dtype == "float32"
                                                              else 2e-2)
    for ref, got in zip(jax.tree.leaves(outs["one-stage"]), jax.tree.leaves(outs["two-stage"]),
                        strict=True):  # this process's shards: the others check theirs
        for r, g in zip(ref.addressable_shards, got.addressable_shards, strict=True):
            r32, g32 = (np.asarray(v.data, np.float32) for v in (r, g))
            np.testing.assert_allclose(g32, r32, rtol=tol,
                                       atol=tol * float(np.max(np.abs(r32), initial=1.0)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(2):  # warm-up
        for f in fns.values():
            jax.block_until_ready(f(*args))
    for _ in range(a.rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - t0)
    report = {"mesh": dict(mesh.shape), "processes": jax.process_count(),
              "device": jax.devices()[0].device_kind, "args": vars(a), "same_values": True}
    for name, f in fns.items():
        report[name] = {"median_ms": statistics.median(times[name]) * 1e3,
                        "cross_host_bytes": cross_host_bytes(f, mesh)}
    one, two = report["one-stage"], report["two-stage"]
    report["two_over_one_step"] = two["median_ms"] / one["median_ms"]
    report["cross_host_bytes_ratio"] = (two["cross_host_bytes"] / one["cross_host_bytes"]
                                        if one["cross_host_bytes"] else None)
    if lead:
        print("outputs and gradients agree (one-stage vs two-stage)")
        for name in fns:
            r = report[name]
            print(f"{name}: {r['median_ms']:9.2f} ms  {r['cross_host_bytes'] / 1e6:9.2f} MB "
                  "across hosts per device")
        print(f"two-stage / one-stage: step {report['two_over_one_step']:.3f}x, bytes "
              f"across hosts {report['cross_host_bytes_ratio'] or 0:.3f}x", flush=True)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    main()

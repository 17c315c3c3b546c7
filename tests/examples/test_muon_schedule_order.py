"""Muon's communication under the trainer's backward pass, read from a scheduled GPU program.

``data/train_step_mesh8x1.hlo.gz`` is ``examples/train_lm.py``'s GPU-preset step (64 x 1024
tokens per GPU, Muon with its defaults: one layer's expert banks per chunk) on the
data-parallel mesh (8, 1), compiled for 8 H100s (jax's virtual topology ``1x8x1`` with
``benchmarks/targets/h100.txtpb``) and scheduled by XLA on the modeled latencies, kept in
schedule order with its backend configs and all metadata but op names dropped
(:func:`shrink`). A machine with jax's CUDA plugin writes it again: ``FIXTURE_COMMAND``, then
``python3 tests/examples/test_muon_schedule_order.py HLO/train_step_mesh8x1.hlo.gz``.
"""

import gzip
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]  # also when run as a script (the fixture's writer)
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import schedule8  # noqa: E402
import train_lm  # noqa: E402

from muon_jax import ShardedMuonState  # noqa: E402

FIXTURE = ROOT / "tests" / "examples" / "data" / "train_step_mesh8x1.hlo.gz"
FIXTURE_COMMAND = (
    "python3 benchmarks/schedule8.py --target-config benchmarks/targets/h100.txtpb "
    "--rates 659.3,1170.2,1999.1 --only train --train-meshes 8x1 --train-optimizers muon "
    "--train-variants 1 --hlo-dir HLO")


def shrink(text: str) -> str:
    """An HLO module without its backend configs, its metadata cut to op names: the schedule
    order, the shapes and the names that :func:`schedule8.backward_order` reads."""
    out = []
    for line in text.split("\n"):
        line = re.sub(r", backend_config=\{.*\}$", "", line)
        meta = re.search(r"metadata=\{([^}]*)\}", line)
        if meta:
            name = re.search(r'op_name="[^"]*"', meta.group(1))
            line = line.replace(meta.group(0), "metadata={%s}" % (name.group(0) if name else ""))
        out.append(line)
    return "\n".join(out)


def test_muon_reduce_scatter_and_gather_start_before_the_last_backward_gemm():
    order = schedule8.backward_order(gzip.open(FIXTURE, "rt").read())
    last = order["last_backward_gemm"]
    assert last is not None and order["reduce-scatter"]["count"] > 0
    assert order["reduce-scatter"]["first"] < last  # gradients reduced under the backward
    assert order["all-gather"]["first"] < last  # a layer's updates gathered under it too


def test_shrink_keeps_what_the_order_reads():
    line = ('  %d = f32[2]{0} dot(%a, %b), metadata={op_name="jit(f)/transpose(jvp())/dot" '
            'scheduling_name="d"}, backend_config={"x":{"y":1}}')
    assert shrink(line) == ('  %d = f32[2]{0} dot(%a, %b), '
                            'metadata={op_name="jit(f)/transpose(jvp())/dot"}')


def _module(*ops: str) -> str:
    """A two-device module whose entry runs ``ops`` (of ``GEMM0``, ``GEMM1``: backward
    GEMMs; ``RS``, ``RS_DONE``: a reduce-scatter of the first one's result) in this order."""
    line = {
        "GEMM0": "%g0 = f32[64,64]{1,0} dot(%p, %p), lhs_contracting_dims={1}, "
                 'rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp())/dot"}',
        "GEMM1": "%g1 = f32[64,64]{1,0} dot(%p, %p), lhs_contracting_dims={1}, "
                 'rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp())/dot"}',
        "RS": "%rs = ((f32[64,64]{1,0}), f32[32,64]{1,0}) reduce-scatter-start(%g0), "
              "channel_id=1, replica_groups={{0,1}}, dimensions={0}, to_apply=%add",
        "RS_DONE": "%rd = f32[32,64]{1,0} reduce-scatter-done(%rs)",
    }
    body = "\n".join(f"  {line[op]}" for op in ops)
    return (
        "HloModule m, num_partitions=2\n\n"
        "%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
        "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n"
        "ENTRY %main (p: f32[64,64]) -> (f32[32,64], f32[64,64]) {\n"
        "  %p = f32[64,64]{1,0} parameter(0)\n"
        f"{body}\n"
        "  ROOT %t = (f32[32,64]{1,0}, f32[64,64]{1,0}) tuple(%rd, %g1)\n}\n")


@pytest.mark.parametrize("ops, before", [
    (("GEMM0", "RS", "GEMM1", "RS_DONE"), 1),  # the reduce-scatter runs under GEMM1
    (("GEMM0", "GEMM1", "RS", "RS_DONE"), 0),  # after the backward pass
])
def test_backward_order_of_a_small_schedule(ops, before):
    order = schedule8.backward_order(_module(*ops))
    assert order["last_backward_gemm"] == 1 + ops.index("GEMM1")
    assert order["reduce-scatter"] == {"count": 1, "before": before, "first": 1 + ops.index("RS")}
    assert order["all-gather"] == {"count": 0, "before": 0, "first": None}


def test_auto_chunks_hold_one_layer_each_on_a_data_parallel_mesh():
    args = train_lm.parse_args(["--optimizer", "muon", "--mesh", "8,1"])  # CPU preset: 2 layers
    mesh = train_lm.build_mesh(args.mesh)
    assert train_lm.muon_chunk_bytes(args, train_lm.build_mesh("1,8")) is None  # no data axis
    assert train_lm.muon_chunk_bytes(
        train_lm.parse_args(["--muon-chunk-bytes", "0"]), mesh) is None
    _, optimizer = train_lm.create("muon", args, mesh)
    (state,) = [s for s in jax.tree.leaves(optimizer.opt_state,
                                           is_leaf=lambda x: isinstance(x, ShardedMuonState))
                if isinstance(s, ShardedMuonState)]
    plan = state.plan
    chunked = [s for s in plan.stacks if len(s.chunks) > 1]
    assert chunked  # the expert banks' stack
    for s in chunked:
        batch = [plan.leaves[i].view.batch for i in s.leaves]
        layer = [int(re.search(r"blocks\W+(\d+)", plan.leaves[i].path).group(1))
                 for i in s.leaves]
        row_layer = np.repeat(layer, batch)  # the layer of each row of the stack
        n = plan.num_shards
        ends = np.cumsum(s.chunks) * n  # chunk j: the n * chunks[j] rows before ends[j]
        layers = [set(row_layer[e - r * n: e]) for e, r in zip(ends, s.chunks, strict=True)]
        assert layers == [{i} for i in range(args.layers)]


def test_muon_chunk_bytes_flag():
    assert train_lm.parse_args([]).muon_chunk_bytes == "auto"
    assert train_lm.parse_args(["--muon-chunk-bytes", "1024"]).muon_chunk_bytes == 1024
    with pytest.raises(train_lm.UsageError, match="muon-chunk-bytes"):
        train_lm.parse_args(["--muon-chunk-bytes", "-1"])


if __name__ == "__main__":  # write the fixture from a compiled module (FIXTURE_COMMAND's)
    with gzip.open(sys.argv[1], "rt") as f:
        text = shrink(f.read())
    FIXTURE.parent.mkdir(exist_ok=True)
    with gzip.open(FIXTURE, "wt", compresslevel=9) as f:
        f.write(text)
    print(FIXTURE, schedule8.backward_order(text))

"""accel_kernels: the accelerator kernels `moe` and `muon_jax` stand on, one package per operation.

* `accel_kernels.gmm`: grouped GEMMs (bf16 and FP8, ragged and capacity-padded token layouts);
* `accel_kernels.symmetric`: products known to be symmetric, from the upper tiles;
* `accel_kernels.quant`: row-wise and column-wise FP8 quantization of GEMM operands;
* `accel_kernels.wire`: the FP8 wire codec and the row gathers around an exchange;
* `accel_kernels.fp8` (e4m3 + E8M0 block scales packed four per int32 word) and
  `accel_kernels.activations` (gated activations), the formats the kernels compute in.

Each operation's ``api.py`` is its registry (`accel_kernels.registry`: one ``implementation``
argument, one map of names to implementation modules imported on first use, one rule for
fallback and refusal, one shim for old spellings) over an XLA reference (``xla.py``), Pallas
Triton kernels (``triton.py``: NVIDIA GPUs before Hopper, interpreted on the CPU for tests)
and Pallas Mosaic GPU kernels (``mosaic.py``: Hopper). What the kernels share:
`accel_kernels.platform` (which accelerator programs are compiled for),
`accel_kernels.mosaic_gpu` (loading, launching, register layouts, e4m3 in registers),
`accel_kernels.mosaic_tiles` (the wgmma tile pipeline of the GEMM-like kernels),
`accel_kernels.tiling`, `accel_kernels.vma` (varying axes under ``shard_map``) and
`accel_kernels.lowering` (the jax versions the kernels are tested on). Nothing here imports
`moe`, `muon_jax` or `xla_comm`.
"""

from accel_kernels import activations, fp8, registry
from accel_kernels.gmm import api as gmm_api
from accel_kernels.platform import (
    compiling_for_cuda,
    cuda_capability,
    prefer_mosaic_gpu,
    target_platform,
)
from accel_kernels.quant import api as quant_api
from accel_kernels.registry import Implementation
from accel_kernels.symmetric import api as symmetric_api
from accel_kernels.wire import api as wire_api

__all__ = [
    "Implementation",
    "activations",
    "compiling_for_cuda",
    "cuda_capability",
    "fp8",
    "gmm_api",
    "prefer_mosaic_gpu",
    "quant_api",
    "registry",
    "symmetric_api",
    "target_platform",
    "wire_api",
]

"""The expert layer's kernels, one package per operation.

* `moe.kernels.gmm`: the grouped GEMMs of the expert layer (bf16 and FP8, both token layouts);
* `moe.kernels.quant`: the row-wise and column-wise FP8 quantization of the GEMMs' operands;
* `moe.kernels.wire`: the wire codec and the row gathers around the dispatch exchanges.

Each package holds the XLA reference (``xla.py``, what runs where no kernel does and what the
kernels give the same results as), the Pallas Triton implementation (``triton.py``: NVIDIA
GPUs before Hopper; interpreted on the CPU for tests), the Pallas Mosaic GPU implementation
(``mosaic.py``: Hopper), and one ``api.py``: the registry that chooses among them by platform
and shape (``'auto'``) or by an explicit name, the only module the layer calls.

Shared by the packages: `moe.kernels.platform` (which accelerator), `moe.kernels.vma`
(varying-axes types under ``shard_map``), `moe.kernels.tiling` (tile sizes, padding) and
`moe.kernels.lowering` (tested jax versions, lowering checks). Nothing here imports the layer:
only `moe.fp8` and `moe.activations`, which import nothing of moe's above them.
"""

from moe.kernels.gmm import api as gmm_api
from moe.kernels.quant import api as quant_api
from moe.kernels.wire import api as wire_api

__all__ = ["gmm_api", "quant_api", "wire_api"]

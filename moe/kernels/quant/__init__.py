"""FP8 quantization: the XLA references, Triton, Mosaic GPU, and the registry
(`moe.kernels.quant.api`)."""

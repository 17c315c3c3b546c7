"""FP8 quantization: the XLA references, Triton, Mosaic GPU, and the registry
(`accel_kernels.quant.api`)."""

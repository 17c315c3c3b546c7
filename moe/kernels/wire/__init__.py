"""The wire codec and gathers: XLA, Triton, Mosaic GPU, and the registry
(`moe.kernels.wire.api`)."""

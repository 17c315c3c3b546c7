"""The wire codec and gathers: XLA, Triton, Mosaic GPU, and the registry
(`accel_kernels.wire.api`)."""

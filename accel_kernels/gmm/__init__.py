"""Grouped GEMMs: the XLA ones, Triton, Mosaic GPU, and the registry (`accel_kernels.gmm.api`)."""

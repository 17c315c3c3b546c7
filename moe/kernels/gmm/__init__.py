"""Grouped GEMMs: the XLA ones, Triton, Mosaic GPU, and the registry (`moe.kernels.gmm.api`)."""

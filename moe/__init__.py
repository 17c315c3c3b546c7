"""moe: an expert-parallel Mixture-of-Experts layer for Flax NNX with an FP8 wire format."""

"""quantkit: quantize a causal LM (AWQ INT4, FP8), write compressed-tensors, run and measure it."""

__version__ = "0.1.0"

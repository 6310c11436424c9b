"""Offline quantization: calibration text, the layer walk, the algorithms (rtn, awq, gptq) and the
pipeline."""

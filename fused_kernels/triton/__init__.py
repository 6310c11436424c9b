"""The Triton backend: W4A16 and FP8 kernels with their launchers (`w4a16`, `fp8`), autotune
configs keyed on a bucketed M (`configs`), and the device checks, grids and launches they share
(`launch`). Triton is imported only when a kernel here first runs."""

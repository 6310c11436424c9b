"""Kernel benchmarks, `python -m quantkit.evals.kernels.bench_w4a16` (INT4 and, through
`bench_fp8`, FP8 against dense matmul and the measured copy bandwidth)."""

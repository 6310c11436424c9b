"""Fused quantized-matmul kernels, their pure-torch references, backend dispatch and benchmarks.

Layer L1 of quantkit: imports only `quantkit.errors`, `quantkit.format.scheme` and
`quantkit.format.packing`. Nothing heavy is imported here; Triton loads only when the triton
backend is used.

- `dispatch`: `int4_linear`, `prepare_int4` / `PreparedInt4`, backend choice and fallbacks.
- `w4a16_reference`: dequantize + fp32 matmul, the oracle of every W4A16 kernel.
- `w4a16_triton` (+ `w4a16_configs`): Triton GEMM (prefill) and split-K GEMV (decode).
- `w4a16_cpu` (+ `w4a16_cpu_source`, `cpu_build`): compiled C GEMV and dequantize + MKL.
- `fp8_dispatch`: `fp8_linear`, `prepare_fp8` / `PreparedFp8` (W8A16 and W8A8, same backends).
- `fp8_reference`, `fp8_triton` (W8A16 GEMM + GEMV, fp8 `tl.dot` W8A8), `fp8_cpu` (+
  `fp8_cpu_source`): the FP8 kernels; `fp8_checks`: their input checks.
- `bench`: `python -m quantkit.fused_kernels.bench`, decode and prefill timings against dense
  matmul and the measured copy bandwidth.
"""

"""Fused quantized-matmul kernels, their pure-torch references, their registry and benchmarks.

Layer L1 of quantkit: imports only `quantkit.errors`, `quantkit.format.scheme` and
`quantkit.format.packing`. Nothing heavy is imported here; Triton loads only when the triton
backend is used.

- `kernel_registry`: every kernel in one priority list (`KERNELS`), `choose_kernel` and the
  fallbacks; a new backend is one kernel file + one entry there.
- `packed_weights`: `PackedInt4`, `PackedFp8`, the value types a kernel takes a layer's weights as.
- `prepared_linear`: `prepare_linear` -> `PreparedLinear` (INT4 and FP8), and the loose-tensor
  `prepare_int4` / `int4_linear`, `prepare_fp8` / `fp8_linear`.
- `w4a16_reference`: dequantize + fp32 matmul, the oracle of every W4A16 kernel.
- `w4a16_triton` (+ `w4a16_configs`): Triton GEMM (prefill) and split-K GEMV (decode).
- `w4a16_cpu` (+ `w4a16_cpu_source`, `cpu_build`): compiled C GEMV and dequantize + MKL.
- `fp8_reference`, `fp8_triton` (W8A16 GEMM + GEMV, fp8 `tl.dot` W8A8), `fp8_cpu` (+
  `fp8_cpu_source`): the FP8 kernels; `fp8_checks`: their input checks.
- `triton_launch`, `cpu_launch`: what the Triton and the CPU launchers share (device and path
  checks, grids and launches; library loading, status codes, the bound-layer call).
- `bench`: `python -m quantkit.fused_kernels.bench`, decode and prefill timings against dense
  matmul and the measured copy bandwidth.
"""

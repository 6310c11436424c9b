"""Fused quantized-matmul kernels: the registry and the shared types at the top, one folder per
backend below.

- `kernel_registry`: every kernel in one priority list (`KERNELS`), `choose_kernel` and the
  fallbacks; each kernel says whether it can run a format on a device and why not. A new
  backend is one folder (or one module in an existing one) plus one entry there.
- `packed_weights`: `PackedInt4`, `PackedFp8`, the value types a kernel takes a layer's weights as.
- `checks`: the input checks every launcher shares (dtype, shape, device; expected vs got).
- `prepared_linear`: `prepare_linear` -> `PreparedLinear` (INT4 and FP8), and the loose-tensor
  `prepare_int4` / `int4_linear`, `prepare_fp8` / `fp8_linear`.
- `reference/`: pure-torch dequantize + matmul, the oracle of every kernel (`w4a16`, `fp8`).
- `triton/`: the Triton kernels (`w4a16`: GEMM for prefill, split-K GEMV for decode; `fp8`:
  W8A16 and fp8 `tl.dot` W8A8), their autotune `configs` and what the launchers share (`launch`).
- `cpu/`: the C kernels, real `.c`/`.h` files in `cpu/csrc/`, compiled at first use (`build`),
  typed through one ctypes ABI (`abi`), loaded and called through `launch`; `w4a16`, `fp8`,
  `bf16_gemv` and the one-call decode step (`decode`).

The layering test holds a backend to the shared types and checks: no backend imports another
or the registry. Benchmarks of these kernels live in `quantkit.evals.kernels`.
"""

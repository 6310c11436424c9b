"""The CPU backend: C kernels in `csrc/` (real .c/.h files), compiled at first use for this
machine's instruction set (`build`), declared once for ctypes (`abi`) and called through
`launch`. `w4a16` and `fp8` are the GEMV/GEMM launchers, `bf16_gemv` the dense bf16/int8 head,
`decode` the one-call decode step of a whole model."""

"""Pure-torch references of every kernel: dequantize with `quantkit.format.packing`, then an fp32
matmul. Importable without Triton or a compiler; the oracle the kernel tests compare against."""

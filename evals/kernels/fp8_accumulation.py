"""W8A8 fp8 GEMM: error and time for each way of moving the fp8 MMA's sums into fp32:
`python -m quantkit.evals.kernels.fp8_accumulation` (needs a CUDA GPU with fp8 tensor cores).

Hopper's fp8 MMA adds its products with fewer bits than fp32; `_fp8_gemm_kernel`'s PROMOTE_K
says how many K products it sums before the fp32 accumulator takes them (-1 never, 0 once a K
step, 32 after every MMA). Error: max |y - ref| / max (|x| @ |w|.T) and the relative Frobenius
error, ref in float64 on the CPU from the same fp8 codes and scales; time by `do_bench`.
"""

from __future__ import annotations

import argparse

import torch

from quantkit.evals.common import run_main


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m quantkit.evals.kernels.fp8_accumulation",
        description="W8A8 fp8 GEMM error and time for each way of promoting the MMA's sums "
        "(needs a CUDA GPU with fp8 tensor cores).",
    ).parse_args(argv)
    import triton

    import quantkit.fused_kernels.triton.fp8 as fp8
    from quantkit.format.packing import quantize_fp8, quantize_fp8_per_token

    if not torch.cuda.is_available() or not fp8.fp8_dot_supported(torch.device("cuda")):
        raise SystemExit("fp8_accumulation: expected a CUDA GPU with fp8 tensor cores, got none")
    torch.manual_seed(0)
    default = fp8._PROMOTE_K
    try:
        for m, n, k in [(300, 1536, 576), (2048, 4096, 4096), (2048, 4096, 14336),
                        (512, 14336, 4096)]:  # fmt: skip
            w8, s = quantize_fp8(torch.randn(n, k))
            wd = w8.double() * s.double()
            x = torch.randn(m, k).to(torch.bfloat16)
            x8, sx = quantize_fp8_per_token(x.float())
            xr = x8.double() * sx.double()
            ref = xr @ wd.T
            mag = (xr.abs() @ wd.abs().T).max()
            w8, s, xc = w8.cuda(), s.cuda(), x.cuda()
            for promote in (-1, 0, 32):
                fp8._PROMOTE_K = promote
                y = fp8.fp8_linear_triton(xc.float(), w8, s, act_dynamic=True).double().cpu()
                err = ((y - ref).abs().max() / mag).item()
                rel = ((y - ref).norm() / ref.norm()).item()
                args = (xc, w8, s)
                ms = triton.testing.do_bench(
                    lambda a=args: fp8.fp8_linear_triton(*a, act_dynamic=True)
                )
                tflops = 2 * m * n * k / ms / 1e9
                print(f"{m}x{n}x{k} promote {promote:>3}: err/mag {err:.1e} rel {rel:.1e} "
                      f"{ms * 1e3:.1f} us {tflops:.0f} TFLOPS", flush=True)  # fmt: skip
    finally:
        fp8._PROMOTE_K = default
    return 0


if __name__ == "__main__":
    run_main(main)

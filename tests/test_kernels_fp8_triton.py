"""Triton FP8 kernels (W8A16 and W8A8) under TRITON_INTERPRET=1, against the pure-torch reference.

As in test_kernels_triton.py (read its docstring for why): `test_interpreter_suite` runs this
file again in a fresh process that set TRITON_INTERPRET=1 before importing Triton; the tests
marked `interpreted` run there. The interpreter loads fp8 tensors and multiplies fp8 tiles in
numpy, so the W8A8 GEMM's fp8 `tl.dot` runs here too.

The sweep covers M {1, 3, 16, 33} x N {64, 200, 576} x K {128, 384, 1000} x {W8A16, W8A8} x
{fp16, fp32} with a pairwise covering subset plus odd-shaped extras; every case runs the path
`auto` picks (GEMV for M <= 16, GEMM above) and, for M <= 16, the GEMM too. Per-token
activation quantization is bit-exact against `quantkit.format.packing` on the fixed example of
test_kernels_fp8.py. `test_fp8_kernels_compile_for_hopper` lowers the kernels, the fp8 `tl.dot`
included, to sm_90 code without a GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from quantkit.errors import KernelUnavailableError
from quantkit.format.packing import dequantize_fp8, quantize_fp8, quantize_fp8_per_token
from quantkit.fused_kernels.reference.fp8 import fp8_linear_reference
from tests.test_kernels_fp8 import fixed_token
from tests.test_kernels_triton import pairwise_cases

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install 'quantkit[kernels]')", allow_module_level=True
    )

MODULE = "quantkit.fused_kernels.triton.fp8"
AXES: dict[str, tuple] = {
    "m": (1, 3, 16, 33),
    "n": (64, 200, 576),
    "k": (128, 384, 1000),
    "act_dynamic": (False, True),
    "dtype": (torch.float16, torch.float32),
}
EXTRA_CASES = [
    dict(m=5, n=77, k=200, act_dynamic=True, dtype=torch.float32),
    dict(m=2, n=13, k=64, act_dynamic=False, dtype=torch.float16),
    dict(m=17, n=9, k=96, act_dynamic=True, dtype=torch.float16),
]
CASES = pairwise_cases(AXES) + EXTRA_CASES


def _case_id(c: dict) -> str:
    kind = "w8a8" if c["act_dynamic"] else "w8a16"
    return f"M{c['m']}-N{c['n']}-K{c['k']}-{kind}-{str(c['dtype']).removeprefix('torch.')}"


CHILD_ENV = "QUANTKIT_TRITON_FP8_CHILD"
IN_CHILD = os.environ.get(CHILD_ENV) == "1"
interpreted = pytest.mark.skipif(
    not IN_CHILD, reason="runs in test_interpreter_suite's child process (TRITON_INTERPRET=1)"
)


@pytest.mark.skipif(IN_CHILD, reason="this is the child")
def test_interpreter_suite() -> None:
    """Run this file's `interpreted` tests in a process that set TRITON_INTERPRET=1 first."""
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1", **{CHILD_ENV: "1"})
    env.pop("QUANTKIT_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-10000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@pytest.fixture(scope="module")
def tk():
    module = importlib.import_module(MODULE)
    assert module.is_interpreted()
    return module


def tolerances(x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """fp32: both sides sum exact products in fp32 in different orders (and scale once vs per
    weight): 1e-5 of sum |x| |w| is a 4x margin at K = 1000. fp16: the output is rounded to
    fp16 (2^-11 of |y|), the reference's in fp32."""
    magnitude = (x.float().abs() @ w.abs().T).max().item()
    if x.dtype == torch.float32:
        return dict(atol=1e-5 * magnitude, rtol=1e-5)
    return dict(atol=1e-5 * magnitude, rtol=2.0**-10)


@interpreted
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp8_matches_reference(tk, case: dict) -> None:
    gen = torch.Generator().manual_seed(case["m"])
    w8, scale = quantize_fp8(torch.randn(case["n"], case["k"], generator=gen))
    x = torch.randn(case["m"], case["k"], generator=gen).to(case["dtype"])
    bias = torch.randn(case["n"], generator=gen).to(case["dtype"])
    act = case["act_dynamic"]
    ref = fp8_linear_reference(x.float(), w8, scale, act_dynamic=act, bias=bias.float())
    tol = tolerances(x, dequantize_fp8(w8, scale))
    for path in ["auto", "gemm"] if case["m"] <= 16 else ["auto"]:
        y = tk.fp8_linear_triton(x, w8, scale, act_dynamic=act, bias=bias, path=path)
        assert y.dtype == x.dtype and y.shape == (case["m"], case["n"])
        torch.testing.assert_close(y.float(), ref, **tol, msg=lambda m, p=path: f"{p}: {m}")


def test_sweep_is_pairwise_covering() -> None:
    import itertools

    for a, b in itertools.combinations(list(AXES), 2):
        assert {(c[a], c[b]) for c in CASES} >= set(itertools.product(AXES[a], AXES[b])), (a, b)
    assert len(CASES) < 30


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_quantization_is_bit_exact(tk, dtype: torch.dtype) -> None:
    x, expected = fixed_token(dtype)
    x8, sx = tk.quantize_per_token_triton(x)
    ref8, ref_s = quantize_fp8_per_token(x)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    assert torch.equal(sx, ref_s)
    if dtype == torch.float32:
        assert torch.equal(x8.float(), expected) and sx.item() == 1.0
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 700, generator=gen) * torch.logspace(-8, 3, 9).reshape(9, 1)
    x[0] = 0.0  # scale clamped to 1e-10
    x8, sx = tk.quantize_per_token_triton(x.to(dtype))
    ref8, ref_s = quantize_fp8_per_token(x.to(dtype))
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    assert torch.equal(sx, ref_s)


@interpreted
def test_split_k_and_single_split_agree(tk) -> None:
    w8, scale = quantize_fp8(torch.randn(96, 512))
    x = torch.randn(4, 512)
    ref = fp8_linear_reference(x, w8, scale, act_dynamic=False)
    for split in (1, 4):
        cfg = tk.BlockConfig(block_m=4, block_n=32, block_k=64, split_k=split)
        y = tk.fp8_linear_triton(x, w8, scale, act_dynamic=False, path="gemv", config=cfg)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


@interpreted
def test_triton_rejects_bad_inputs(tk) -> None:
    w8, scale = quantize_fp8(torch.randn(64, 128))
    kw = dict(act_dynamic=False)
    with pytest.raises(KernelUnavailableError, match="float16 or float32 .*got bfloat16"):
        tk.fp8_linear_triton(torch.randn(1, 128).bfloat16(), w8, scale, **kw)
    with pytest.raises(ValueError, match=r"expected shape \[\.\.\., 128\].*got \(1, 100\)"):
        tk.fp8_linear_triton(torch.randn(1, 100), w8, scale, **kw)
    with pytest.raises(ValueError, match=r"weight_scale: expected a float \[64, 1\]"):
        tk.fp8_linear_triton(torch.randn(1, 128), w8, scale[:32], **kw)
    with pytest.raises(ValueError, match="path: expected"):
        tk.fp8_linear_triton(torch.randn(1, 128), w8, scale, path="fast", **kw)
    with pytest.raises(ValueError, match="takes at most 16 rows, got 33"):
        tk.fp8_linear_triton(torch.randn(33, 128), w8, scale, path="gemv", **kw)


@interpreted
def test_dispatch_runs_triton_and_falls_back_from_w8a8(tk, monkeypatch) -> None:
    from quantkit.format.scheme import QuantScheme
    from quantkit.fused_kernels.prepared_linear import prepare_fp8

    monkeypatch.setenv("QUANTKIT_BACKEND", "triton")
    w8a8 = QuantScheme("fp8", activations="dynamic")
    w8, scale = quantize_fp8(torch.randn(64, 128))
    x = torch.randn(2, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = prepare_fp8(w8, scale, scheme=w8a8)
    assert prepared.backend == "triton" and prepared.act_dynamic
    ref = fp8_linear_reference(x, w8, scale, act_dynamic=True)
    torch.testing.assert_close(prepared(x), ref, rtol=1e-5, atol=1e-4)
    # a GPU without fp8 tensor cores (faked): W8A16, one warning line
    monkeypatch.setattr(tk, "fp8_dot_supported", lambda device: False)
    with pytest.warns(RuntimeWarning, match="W8A8 needs fp8 matmuls") as caught:
        prepared = prepare_fp8(w8, scale, scheme=w8a8)
    assert len(caught) == 1 and not prepared.act_dynamic
    ref = fp8_linear_reference(x, w8, scale, act_dynamic=False)
    torch.testing.assert_close(prepared(x), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(KernelUnavailableError, match="W8A8 expected a GPU with fp8"):
        tk.fp8_linear_triton(x, w8, scale, act_dynamic=True)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import quantkit.fused_kernels.triton.fp8 as T
    import triton.language as tl

    def compile(kernel, pointers, constants, arch=90, **options):
        sig = {n: "constexpr" if n in constants else pointers.get(n, "i32")
               for n in kernel.arg_names}
        triton.compile(ASTSource(kernel, sig, constants), target=GPUTarget("cuda", arch, 32),
                       options=options)

    w = dict(w_ptr="*fp8e4nv", s_ptr="*bf16", xs_ptr="*fp32")
    # W8A8: fp8 operands in tl.dot (mma on sm_89, wgmma on sm_90), each way of promoting its sums
    for arch, promote in ((89, 32), (90, 32), (90, 0), (90, -1)):
        compile(T._fp8_gemm_kernel, dict(w, x_ptr="*fp8e4nv", b_ptr="*bf16", y_ptr="*bf16"),
                dict(HAS_XS=True, HAS_BIAS=True, FP8_DOT=True, DOT_PRECISION="ieee",
                     BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, PROMOTE_K=promote),
                arch=arch, num_warps=8, num_stages=3)
    compile(T._fp8_gemm_kernel, dict(w, x_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16"),
            dict(HAS_XS=False, HAS_BIAS=False, FP8_DOT=False, DOT_PRECISION="ieee",
                 BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, PROMOTE_K=32), num_warps=4,
            num_stages=4)
    for block_m, x in ((1, "*bf16"), (16, "*fp8e4nv")):
        compile(T._fp8_gemv_kernel, dict(w, x_ptr=x, y_ptr="*fp32"),
                dict(HAS_XS=x != "*bf16", COMPUTE=tl.float16 if block_m == 16 else tl.bfloat16,
                     DOT_PRECISION="ieee", BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=256,
                     SPLIT_K=4))
    compile(T._quant_tokens_kernel, dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32",
                                         EPS="fp32"), dict(BLOCK_K=1024))
    print("compiled for sm_89/sm_90")
    """
)


@pytest.mark.skipif(IN_CHILD, reason="runs once, in the parent")
def test_fp8_kernels_compile_for_hopper(tmp_path) -> None:
    """Lower the kernels to sm_89/sm_90 machine code without a GPU (Triton ships ptxas): type or
    lowering errors the interpreter cannot see (the fp8 mma, the bitcasts) show up here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton install has no CUDA toolchain (ptxas)")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "compiled for sm_89/sm_90" in proc.stdout


_GPU_SCRIPT = textwrap.dedent(
    """
    import torch
    from quantkit.fused_kernels.triton.fp8 import fp8_dot_supported, fp8_linear_triton
    from quantkit.fused_kernels.triton.fp8 import quantize_per_token_triton
    from quantkit.format.packing import quantize_fp8, quantize_fp8_per_token

    acts = [False] + ([True] if fp8_dot_supported(torch.device("cuda")) else [])
    tols = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    for m, n, k in [(1, 4096, 4096), (7, 200, 384), (16, 576, 1536), (300, 1536, 576),
                    (33, 77, 200), (2048, 4096, 4096)]:
        w8, s = quantize_fp8(torch.randn(n, k))
        w8, s = w8.cuda(), s.cuda()
        wd = w8.double() * s.double()
        for act in acts:
            for dt, tol in tols.items():
                x = torch.randn(m, k, device="cuda").to(dt)
                y = fp8_linear_triton(x, w8, s, act_dynamic=act).double()
                if act:
                    # The reference on the CPU: torch's CUDA division by a scalar multiplies
                    # by its reciprocal (an ulp off), the kernel divides as the CPU does.
                    x8, sx = (t.cuda() for t in quantize_fp8_per_token(x.cpu()))
                    q8, qs = quantize_per_token_triton(x.reshape(m, k))
                    off = (qs.double() - sx.double()).abs().max().item()
                    assert torch.equal(qs, sx), ("scales", m, n, k, dt, off)
                    bad = (q8.view(torch.uint8) != x8.view(torch.uint8)).sum().item()
                    assert bad == 0, ("codes", m, n, k, dt, bad, q8.numel())
                    xr = x8.double() * sx.double()
                else:
                    xr = x.double()
                ref = xr @ wd.T
                mag = (xr.abs() @ wd.abs().T).max()
                err = ((y - ref).abs().max() / mag).item()
                # W8A8 GEMM (M > 16): the fp8 MMA adds with fewer bits than fp32 (sm_90); its
                # sums move to fp32 once a K step: 6e-6..6e-5 on an H200, 3e-4..7e-4 if never.
                bound = max(tol, 1e-4) if act and m > 16 else tol
                assert err < bound, (m, n, k, act, dt, err)
    print("gpu sweep ok", "w8a8" if True in acts else "w8a16 only")
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_triton_on_gpu_matches_reference() -> None:
    """Compiled kernels on CUDA (fp16, bf16, fp32; autotuned; W8A8 on sm_89+), in a fresh
    process so that the interpreter-mode module of this file's other tests is not the one under
    test."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu sweep ok" in proc.stdout

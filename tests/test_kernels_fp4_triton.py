"""The Triton NVFP4 / MXFP4 kernel under TRITON_INTERPRET=1, against the pure-torch reference.

As test_kernels_triton.py (its docstring says why): `test_interpreter_suite` runs this file again
in a fresh process that set TRITON_INTERPRET=1 before importing Triton; the tests marked
`interpreted` run there. The dequantized tile is bit-exact with `quantkit.format` (fp32 products
of exact values), so in fp32 the kernel and the reference differ only by the order of the fp32
sums; fp16 adds the cast of the tile and of the output. `test_fp4_kernel_compiles_for_hopper`
lowers the kernel to sm_90 code without a GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quantkit.format.nvfp4 import nvfp4_global_scale
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.packed_weights import PackedFp4
from quantkit.fused_kernels.reference.fp4 import dequantize_fp4_weights, fp4_linear_reference

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install 'quantkit[kernels]')", allow_module_level=True
    )

MODULE = "quantkit.fused_kernels.triton.fp4"
CHILD_ENV = "QUANTKIT_TRITON_FP4_CHILD"
IN_CHILD = os.environ.get(CHILD_ENV) == "1"
interpreted = pytest.mark.skipif(
    not IN_CHILD, reason="runs in test_interpreter_suite's child process (TRITON_INTERPRET=1)"
)
# (kind, M, N, K, activations, dtype): both paths' shapes, N and M off the block sizes.
CASES = [
    ("nvfp4", 1, 64, 128, "none", torch.float32),
    ("nvfp4", 3, 200, 384, "none", torch.float16),
    ("nvfp4", 33, 77, 96, "dynamic", torch.float32),
    ("nvfp4", 17, 130, 160, "dynamic", torch.float16),
    ("mxfp4", 1, 200, 384, "none", torch.float16),
    ("mxfp4", 5, 64, 96, "none", torch.float32),
    ("mxfp4", 40, 129, 256, "none", torch.float32),
]


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


def packed(kind: str, n: int, k: int, act: str, seed: int) -> tuple[PackedFp4, QuantScheme]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[0, :8] *= 40  # outliers; a zero group; a tiny row (E4M3 subnormal / clamped scales)
    w[1, : 2 * 16] = 0.0
    w[2] *= 1e-5
    scheme = QuantScheme(kind, activations=act)
    tensors = scheme.format.round_and_store(w, QuantScheme(kind), dtype=torch.float32)
    if act == "dynamic":
        tensors["input_global_scale"] = nvfp4_global_scale(3.0)
    return PackedFp4.from_tensors(tensors, scheme=scheme, in_features=k), scheme


@interpreted
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}-M{c[1]}-N{c[2]}-K{c[3]}-{c[4]}-{str(c[5])[6:]}"
)
def test_fp4_matches_reference(tk, case) -> None:
    kind, m, n, k, act, dtype = case
    weights, _ = packed(kind, n, k, act, seed=m)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    dynamic = act == "dynamic"
    y = tk.fp4_linear_triton(x, weights, act_dynamic=dynamic, bias=bias)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = fp4_linear_reference(x.float(), weights, act_dynamic=dynamic, bias=bias.float())
    w = dequantize_fp4_weights(weights)
    magnitude = (x.float().abs() @ w.abs().T).max().item()
    if dtype == torch.float32 or dynamic:  # fp32 GEMM: only the order of the sums differs
        tol = dict(atol=1e-5 * magnitude, rtol=1e-5 if dtype == torch.float32 else 2.0**-10)
    else:  # the tile is cast to fp16 (2^-11 of each product at most), then the output
        tol = dict(atol=2.0**-11 * magnitude, rtol=2.0**-10)
    torch.testing.assert_close(y.float(), ref, **tol)


@interpreted
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_dequantized_tile_is_bit_exact(tk, kind: str) -> None:
    """x = I: y = W.T row by row, in fp32 with one nonzero product per sum (exact)."""
    k = 64
    weights, _ = packed(kind, 48, k, "none", seed=3)
    y = tk.fp4_linear_triton(torch.eye(k), weights)
    assert torch.equal(y, dequantize_fp4_weights(weights).T)


@interpreted
def test_registry_picks_triton_under_the_interpreter() -> None:
    from quantkit.fused_kernels.kernel_registry import choose_kernel

    assert choose_kernel(QuantScheme("mxfp4"), "cpu", "triton").name == "triton-mxfp4"


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import quantkit.fused_kernels.triton.fp4 as T

    def compile(kernel, pointers, constants, arch=90, **options):
        sig = {n: "constexpr" if n in constants else pointers.get(n, "i32")
               for n in kernel.arg_names}
        triton.compile(ASTSource(kernel, sig, constants), target=GPUTarget("cuda", arch, 32),
                       options=options)

    for nv in (True, False):
        for x in ("*bf16", "*fp32"):
            compile(T._fp4_gemm_kernel,
                    dict(x_ptr=x, w_ptr="*u8", s_ptr="*u8", g_ptr="*fp32", b_ptr=x, y_ptr=x),
                    dict(NV=nv, HAS_BIAS=True, DOT_PRECISION="ieee", BLOCK_M=16, BLOCK_N=64,
                         BLOCK_K=32, GROUP_M=8), num_warps=4, num_stages=3)
    print("compiled for sm_90")
    """
)


@pytest.mark.skipif(IN_CHILD, reason="runs once, in the parent")
def test_fp4_kernel_compiles_for_hopper(tmp_path) -> None:
    """Lower the kernel to sm_90 machine code without a GPU (Triton ships ptxas): type or
    lowering errors the interpreter cannot see (the bitcasts, the uint8 loads) show up here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton install has no CUDA toolchain (ptxas)")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "compiled for sm_90" in proc.stdout


_GPU_SCRIPT = textwrap.dedent(
    """
    import dataclasses
    import sys
    import torch
    sys.path.insert(0, ".")
    from tests.test_kernels_fp4_triton import CASES, packed
    from quantkit.fused_kernels.reference.fp4 import dequantize_fp4_weights, fp4_linear_reference
    import quantkit.fused_kernels.triton.fp4 as T

    assert not T.is_interpreted()
    cases = CASES + [("nvfp4", 1, 4096, 4096, "none", torch.bfloat16),
                     ("mxfp4", 16, 14336, 4096, "none", torch.bfloat16),
                     ("nvfp4", 512, 4096, 14336, "dynamic", torch.bfloat16)]
    for kind, m, n, k, act, dtype in cases:
        weights, _ = packed(kind, n, k, act, seed=m)
        weights = dataclasses.replace(weights, **{
            f.name: getattr(weights, f.name).cuda() for f in dataclasses.fields(weights)
            if isinstance(getattr(weights, f.name), torch.Tensor)})
        x = torch.randn(m, k, device="cuda").to(dtype)
        dynamic = act == "dynamic"
        y = T.fp4_linear_triton(x, weights, act_dynamic=dynamic).float()
        ref = fp4_linear_reference(x.float(), weights, act_dynamic=dynamic).float()
        w = dequantize_fp4_weights(weights).float()
        mag = (x.float().abs() @ w.abs().T).max().item()
        err = (y - ref).abs().max().item() / mag
        # fp32: the order of the sums; fp16 / bf16: the tile's and the output's rounding.
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        assert err < tol, (kind, m, n, k, act, dtype, err)
    print("gpu sweep ok")
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp4_triton_on_gpu_matches_reference() -> None:
    """The compiled kernel on CUDA, both formats, both paths, in a fresh process (as the
    interpreter-mode tests of this file must not be the module under test)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu sweep ok" in proc.stdout

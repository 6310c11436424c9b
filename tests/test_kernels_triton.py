"""Triton W4A16 kernels under TRITON_INTERPRET=1, against the pure-torch reference.

TRITON_INTERPRET must be set before `import triton`: triton's own library functions
(tl.cdiv, tl.sum, ...) are decorated when triton is imported, and ours when their module is,
and a kernel mixing interpreted and compiled functions fails. Within a pytest session some
other module may already have imported triton, and setting the variable for the whole session
would turn every other test's kernels (GPU tests included) into interpreted ones. So
`test_interpreter_suite` runs this file again in a fresh process with TRITON_INTERPRET=1 (and
OPENBLAS_NUM_THREADS=1: the interpreter's tl.dot is np.matmul, and OpenBLAS threads competing
with torch's OpenMP threads made a 64x128x64 matmul take 25 ms instead of 0.02 ms on 2 cores);
there the tests marked `interpreted` run, here they are skipped.

The sweep covers M {1, 3, 16, 33} x N {64, 200, 576} x K {128, 384, 1536} x group {32, 64, 128,
per-channel} x {symmetric, asymmetric} x {fp16, fp32} with a pairwise covering subset (every
pair of values of every two axes occurs in some case; `test_sweep_is_pairwise_covering` checks
it) plus odd-shaped extras; QUANTKIT_FULL_SWEEP=1 runs all 576 combinations. Every case runs
the path `auto` picks (GEMV for M <= 16, GEMM above) and, for M <= 16, the GEMM too.
`test_kernels_compile_for_hopper` lowers the kernels to sm_90 code without a GPU; the GPU test
(marked `gpu`) runs them compiled, in a subprocess.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quantkit.errors import KernelUnavailableError
from quantkit.format.packing import (
    dequantize_packed_int4,
    int4_qparams,
    int4_quantize,
    pack_int4,
    pack_zero_points,
    unpack_int4,
    unpack_zero_points,
)
from quantkit.fused_kernels.packed_weights import PackedInt4
from quantkit.fused_kernels.reference.w4a16 import w4a16_linear_reference

# find_spec, not import: importing triton here would decorate its library before a later
# module of the session could set TRITON_INTERPRET.
if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install 'quantkit[kernels]')", allow_module_level=True
    )

MODULE = "quantkit.fused_kernels.triton.w4a16"
AXES: dict[str, tuple] = {
    "m": (1, 3, 16, 33),
    "n": (64, 200, 576),
    "k": (128, 384, 1536),
    "group": (32, 64, 128, -1),
    "symmetric": (False, True),
    "dtype": (torch.float16, torch.float32),
}


def pairwise_cases(axes: dict[str, tuple]) -> list[dict]:
    """A deterministic greedy pairwise covering subset of the product of `axes`.

    Each step takes the first combination (in product order) that covers the most pairs not yet
    covered, cheaper (smaller M*N*K) first among equals, so the interpreter time stays low.
    """
    names = list(axes)
    combos = [dict(zip(names, values, strict=True)) for values in itertools.product(*axes.values())]

    def pairs(case: dict) -> set:
        return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs(c) for c in combos))
    cases = []
    while uncovered:
        best = max(combos, key=lambda c: (len(pairs(c) & uncovered), -c["m"] * c["n"] * c["k"]))
        cases.append(best)
        uncovered -= pairs(best)
    return cases


# Odd shapes beyond the axes: N not a multiple of 8 (zero-point words half used), per-channel
# K not a multiple of 8 or of BLOCK_K (masked tail), M between the GEMV buckets.
EXTRA_CASES = [
    dict(m=5, n=77, k=200, group=-1, symmetric=False, dtype=torch.float32),
    dict(m=2, n=13, k=64, group=32, symmetric=True, dtype=torch.float16),
    dict(m=17, n=9, k=96, group=32, symmetric=False, dtype=torch.float32),
]
# QUANTKIT_FULL_SWEEP=1 runs the whole product (576 cases, ~minutes) instead of the covering
# subset, for a one-off check: QUANTKIT_FULL_SWEEP=1 pytest tests/test_kernels_triton.py
FULL_SWEEP = os.environ.get("QUANTKIT_FULL_SWEEP") == "1"
ALL_CASES = [dict(zip(AXES, v, strict=True)) for v in itertools.product(*AXES.values())]
CASES = (ALL_CASES if FULL_SWEEP else pairwise_cases(AXES)) + EXTRA_CASES


def _case_id(c: dict) -> str:
    kind = "sym" if c["symmetric"] else "asym"
    dt = str(c["dtype"]).removeprefix("torch.")
    return f"M{c['m']}-N{c['n']}-K{c['k']}-g{c['group']}-{kind}-{dt}"


CHILD_ENV = "QUANTKIT_TRITON_INTERPRET_CHILD"
IN_CHILD = os.environ.get(CHILD_ENV) == "1"
interpreted = pytest.mark.skipif(
    not IN_CHILD, reason="runs in test_interpreter_suite's child process (TRITON_INTERPRET=1)"
)


@pytest.mark.skipif(IN_CHILD, reason="this is the child")
def test_interpreter_suite() -> None:
    """Run this file's `interpreted` tests in a process that set TRITON_INTERPRET=1 first."""
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1", **{CHILD_ENV: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    limit = 7200 if FULL_SWEEP else 600
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
    assert proc.returncode == 0, proc.stdout[-10000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@pytest.fixture(scope="module")
def tk():
    """quantkit.fused_kernels.triton.w4a16, imported in interpreter mode."""
    module = importlib.import_module(MODULE)
    assert module.is_interpreted()
    return module


def make_layer(n: int, k: int, group: int, symmetric: bool, *, seed: int = 0) -> dict:
    """Random W quantized with quantkit.format.packing, as compressed-tensors tensors."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    g = k if group == -1 else group
    scale, zero = int4_qparams(w, group_size=g, symmetric=symmetric)
    codes = int4_quantize(w, scale, zero, group_size=g)
    return dict(
        weight_packed=pack_int4(codes),
        weight_scale=scale,
        weight_zero_point=None if zero is None else pack_zero_points(zero),
        codes=codes,
        zero=zero,
        group=g,
    )


def packed(layer: dict, in_features: int, group_size: int) -> PackedInt4:
    """`make_layer`'s tensors as the launchers take them."""
    names = ("weight_packed", "weight_scale", "weight_zero_point")
    return PackedInt4(*(layer[name] for name in names), in_features, group_size)


def tolerances(x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """(atol, rtol) for a kernel output against the fp32 reference.

    fp32: both sides sum K <= 1536 fp32 products in different orders; the rounding error is
    ~sqrt(K) * 6e-8 relative to sum |x| |w| (2.3e-6 at K=1536), so 1e-5 of that sum is a
    4x margin, while one wrong nibble moves an output by >= 1/K of it (6.5e-4).
    fp16: the kernel rounds each dequantized weight to fp16 for tl.dot (half an ulp, 2^-11
    relative, at worst 2^-11 of sum |x| |w|) and rounds the output to fp16 (2^-11 of |y|).
    """
    magnitude = (x.float().abs() @ w.abs().T).max().item()
    if x.dtype == torch.float32:
        return dict(atol=1e-5 * magnitude, rtol=1e-5)
    return dict(atol=2.0**-11 * magnitude, rtol=2.0**-10)


@interpreted
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_w4a16_matches_reference(tk, case: dict) -> None:
    layer = make_layer(case["n"], case["k"], case["group"], case["symmetric"], seed=case["m"])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case["m"], case["k"], generator=gen).to(case["dtype"])
    bias = torch.randn(case["n"], generator=gen).to(case["dtype"])
    weights = packed(layer, case["k"], layer["group"])
    ref = w4a16_linear_reference(x.float(), weights, bias=bias.float())
    w = dequantize_packed_int4(*weights.tensors, in_features=case["k"], group_size=layer["group"])
    paths = ["auto", "gemm"] if case["m"] <= 16 else ["auto"]
    for path in paths:
        y = tk.w4a16_linear_triton(x, weights, bias=bias, path=path)
        assert y.dtype == x.dtype and y.shape == (case["m"], case["n"])
        tol = tolerances(x, w)
        torch.testing.assert_close(y.float(), ref, **tol, msg=lambda m, p=path: f"{p}: {m}")


def test_sweep_is_pairwise_covering() -> None:
    names = list(AXES)
    for a, b in itertools.combinations(names, 2):
        seen = {(c[a], c[b]) for c in CASES}
        assert seen >= set(itertools.product(AXES[a], AXES[b])), (a, b)
    assert len(CASES) < 40  # the point of the covering subset: far fewer than the 576 combos


@interpreted
@pytest.mark.parametrize(
    "n,k,group,symmetric", [(77, 384, 128, False), (64, 200, -1, False), (40, 96, 32, True)]
)
def test_kernel_unpacking_is_bit_exact(tk, n: int, k: int, group: int, symmetric: bool) -> None:
    """The tile the matmul kernels compute with equals quantkit.format.packing's, bit for bit."""
    layer = make_layer(n, k, group, symmetric)
    wp, scale, zp = layer["weight_packed"], layer["weight_scale"], layer["weight_zero_point"]
    codes, zeros, w = tk.dequantize_triton(wp, scale, zp, in_features=k, group_size=group)
    assert torch.equal(codes, unpack_int4(wp, k))
    assert torch.equal(codes, layer["codes"])
    if symmetric:
        assert zeros is None
    else:
        assert torch.equal(zeros, unpack_zero_points(zp, n))
    ref = dequantize_packed_int4(wp, scale, zp, in_features=k, group_size=layer["group"])
    assert torch.equal(w, ref)


@interpreted
def test_split_k_and_single_split_agree(tk) -> None:
    layer = make_layer(96, 512, 64, False)
    x = torch.randn(4, 512)
    weights = packed(layer, 512, 64)
    one = tk.BlockConfig(block_m=4, block_n=32, block_k=64, split_k=1)
    four = tk.BlockConfig(block_m=4, block_n=32, block_k=64, split_k=4)
    y1 = tk.w4a16_linear_triton(x, weights, path="gemv", config=one)
    y4 = tk.w4a16_linear_triton(x, weights, path="gemv", config=four)
    ref = w4a16_linear_reference(x, weights)
    torch.testing.assert_close(y1, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y4, ref, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize("unpack", [0, 1, 2])
@pytest.mark.parametrize(
    "m,n,k,group,symmetric,split,block_k",
    [(1, 77, 200, -1, False, 1, 64), (3, 96, 384, 64, False, 3, 64),
     (8, 40, 256, 32, True, 2, 32), (1, 50, 352, 32, False, 2, 128),
     (2, 24, 1536, 64, True, 3, 256)],
)  # fmt: skip
def test_every_gemv_unpacking_matches_reference(
    tk, unpack: int, m: int, n: int, k: int, group: int, symmetric: bool, split: int,
    block_k: int,
) -> None:  # fmt: skip
    """The GEMV's three ways to unpack a tile (the nibble gather, and whole words split in
    registers as a 3-D tile or reshaped), each with masked tails in N and K and split-K; whole
    words also in steps of several groups (block_k > group: 352 = 2.75 steps of 4 groups)."""
    layer = make_layer(n, k, group, symmetric)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    weights = packed(layer, k, layer["group"])
    if unpack == 0:
        block_k = min(block_k, k if group == -1 else group)
    config = tk.BlockConfig(
        block_m=1 << (m - 1).bit_length(), block_n=32, block_k=block_k, split_k=split,
        unpack=unpack,
    )  # fmt: skip
    y = tk.w4a16_linear_triton(x, weights, path="gemv", config=config)
    ref = w4a16_linear_reference(x, weights)
    w = dequantize_packed_int4(*weights.tensors, in_features=k, group_size=layer["group"])
    torch.testing.assert_close(y, ref, **tolerances(x, w))


@pytest.fixture(scope="module")
def tc(tk):
    """quantkit.fused_kernels.triton.w4a16_columns, imported in interpreter mode."""
    return importlib.import_module("quantkit.fused_kernels.triton.w4a16_columns")


@interpreted
@pytest.mark.parametrize(
    "n,k,group,symmetric,tile",
    [(77, 200, -1, False, (64, 4, 2)), (96, 384, 64, False, (32, 8, 3)),
     (40, 256, 32, True, (64, 4, 1)), (50, 352, 32, False, (16, 2, 5)),
     (24, 1536, 128, True, (32, 16, 4)), (13, 64, 32, False, (16, 1, 3))],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_column_gemv_matches_reference(
    tc, n: int, k: int, group: int, symmetric: bool, tile: tuple, dtype: torch.dtype
) -> None:
    """One row through the column copy, with tails in N (77, 13 columns), splits that do not
    divide the steps (5 splits of 11 steps), one-word steps, a per-channel group and a bias;
    and the interpreter's default tile."""
    import triton

    layer = make_layer(n, k, group, symmetric)
    weights = packed(layer, k, layer["group"])
    cols = tc.repack_columns(weights)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(n).to(dtype)
    block_n, block_w, split = tile
    config = triton.Config(
        {"BLOCK_N": block_n, "BLOCK_W": block_w, "SPLIT_K": split, "WAVES": 0}, num_warps=4
    )
    w = dequantize_packed_int4(*weights.tensors, in_features=k, group_size=layer["group"])
    ref = w4a16_linear_reference(x.float(), weights, bias=bias.float()).to(dtype)
    for y in (tc.columns_gemv(x, cols, bias=bias, config=config), tc.columns_gemv(x[0], cols,
              bias=bias)):  # fmt: skip
        assert y.dtype == dtype
        torch.testing.assert_close(y.reshape(1, n), ref, **tolerances(x, w))


@interpreted
def test_the_column_copy_holds_the_checkpoints_codes(tc) -> None:
    """The copy is the same codes, scales and zero points, by column: words transposed, each
    zero-point nibble where its column is (N = 77: the last zero-point word half used)."""
    layer = make_layer(77, 128, 32, False)
    cols = tc.repack_columns(packed(layer, 128, 32))
    assert torch.equal(cols.words.T, layer["weight_packed"])
    assert torch.equal(cols.scale.T, layer["weight_scale"])
    assert torch.equal(cols.zero.T.to(torch.int32), layer["zero"] + 8)
    assert unpack_int4(cols.words.T.contiguous(), 128).equal(layer["codes"].to(torch.int8))


@interpreted
def test_the_triton_layer_sends_one_row_to_the_column_copy(tc, monkeypatch) -> None:
    """`TritonInt4Layer`: one row (any leading shape) takes the column GEMV, several rows the
    checkpoint's kernels; a group that is not a multiple of 8 (per-channel K = 100) has no
    column copy and every shape takes the checkpoint's kernels. Every result equals the
    reference."""
    calls = []
    real = tc.columns_gemv
    monkeypatch.setattr(tc, "columns_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for k, group in ((128, 32), (100, -1)):
        layer = make_layer(40, k, group, False)
        weights = packed(layer, k, layer["group"])
        bound = tc.TritonInt4Layer(weights)
        assert (bound.columns is None) == (group == -1)
        w = dequantize_packed_int4(*weights.tensors, in_features=k, group_size=layer["group"])
        for shape in ((1, k), (k,), (1, 1, k), (3, k)):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
            want = w4a16_linear_reference(x.reshape(-1, k), weights).reshape(*shape[:-1], 40)
            torch.testing.assert_close(bound(x), want, **tolerances(x.reshape(-1, k), w))
    assert len(calls) == 3  # the three one-row shapes of the K = 128 layer
    with pytest.raises(ValueError, match="multiple of 8"):
        tc.repack_columns(packed(make_layer(40, 100, -1, False), 100, 100))


@interpreted
def test_autotune_candidates_fit_the_layer() -> None:
    """`clamp_block_k` on whole-word candidates: steps of whole groups where the group size is a
    power of two (STEP_GROUPS), one group per step otherwise, SPLIT_K 0 -> one step a program."""
    import triton

    from quantkit.fused_kernels.triton.configs import clamp_block_k, gemv_configs

    def fitted(group: int, k: int, block_k: int, split_k: int) -> dict:
        cfg = triton.Config({"BLOCK_N": 16, "BLOCK_K": block_k, "SPLIT_K": split_k, "UNPACK": 1})
        (out,) = clamp_block_k([cfg], {"GROUP_SIZE": group, "K": k})
        return out.kwargs

    assert fitted(128, 14336, 512, 0) == dict(
        BLOCK_N=16, BLOCK_K=512, SPLIT_K=28, UNPACK=1, STEP_GROUPS=4
    )
    assert fitted(32, 4096, 128, 2)["STEP_GROUPS"] == 4
    assert "STEP_GROUPS" not in fitted(4096, 4096, 512, 0)  # per channel: one group
    assert fitted(96, 384, 128, 1) == dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, UNPACK=1)
    for bucket in (1, 4, 16):  # every candidate fits some layer of the 8B shapes
        for cfg in clamp_block_k(gemv_configs(bucket), {"GROUP_SIZE": 128, "K": 4096}):
            assert cfg.kwargs["SPLIT_K"] >= 1 and cfg.kwargs["BLOCK_K"] >= 8


@interpreted
def test_triton_rejects_bad_inputs(tk) -> None:
    layer = make_layer(64, 128, 32, False)
    wp, scale, zp = layer["weight_packed"], layer["weight_scale"], layer["weight_zero_point"]
    weights = PackedInt4(wp, scale, zp, 128, 32)
    with pytest.raises(
        KernelUnavailableError, match="expected float16 or float32 activations.*got bfloat16"
    ):
        tk.w4a16_linear_triton(torch.randn(1, 128, dtype=torch.bfloat16), weights)
    with pytest.raises(ValueError, match=r"expected shape \[\.\.\., 128\].*got \(1, 100\)"):
        tk.w4a16_linear_triton(torch.randn(1, 100), weights)
    with pytest.raises(ValueError, match="weight_scale: expected a float"):
        tk.w4a16_linear_triton(torch.randn(1, 128), PackedInt4(wp, scale[:, :2], zp, 128, 32))
    with pytest.raises(ValueError, match="path: expected"):
        tk.w4a16_linear_triton(torch.randn(1, 128), weights, path="fast")
    with pytest.raises(ValueError, match="takes at most 16 rows, got 33"):
        tk.w4a16_linear_triton(torch.randn(33, 128), weights, path="gemv")


@interpreted
def test_dispatch_runs_triton_under_interpreter(tk, monkeypatch) -> None:
    from quantkit.format.scheme import QuantScheme
    from quantkit.fused_kernels.kernel_registry import resolve_backend
    from quantkit.fused_kernels.prepared_linear import int4_linear, prepare_int4

    monkeypatch.setenv("QUANTKIT_BACKEND", "triton")
    assert resolve_backend(torch.device("cpu")) == "triton"
    layer = make_layer(64, 128, 32, False)
    tensors = (layer["weight_packed"], layer["weight_scale"], layer["weight_zero_point"])
    scheme = QuantScheme("int4", group_size=32)
    x = torch.randn(2, 128)
    prepared = prepare_int4(*tensors, scheme=scheme, in_features=128)
    assert prepared.backend == "triton"
    ref = w4a16_linear_reference(x, PackedInt4(*tensors, 128, 32))
    torch.testing.assert_close(prepared(x), ref, rtol=1e-5, atol=1e-4)
    y = int4_linear(x, *tensors, scheme=scheme, in_features=128)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


@interpreted
def test_compiled_step_keeps_a_triton_linear_as_one_opaque_op(tk, monkeypatch) -> None:
    """torch.compile over a prepared Triton linear: one `quantkit::prepared_linear` node in a
    full graph (Dynamo cannot trace Triton's launch; on an H200 `generate --compile` failed
    that way), the same numbers as the eager call, and eager calls stay direct."""
    from quantkit.format.scheme import QuantScheme
    from quantkit.fused_kernels.prepared_linear import prepare_int4

    monkeypatch.setenv("QUANTKIT_BACKEND", "triton")
    layer = make_layer(64, 128, 32, False)
    tensors = (layer["weight_packed"], layer["weight_scale"], layer["weight_zero_point"])
    prepared = prepare_int4(*tensors, scheme=QuantScheme("int4", group_size=32), in_features=128)
    assert prepared.backend == "triton" and prepared.handle >= 0
    seen: list[str] = []

    def record(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(prepared(x)) * 2

    x = torch.randn(3, 128)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=record, fullgraph=True)
    y = compiled(x)
    assert "quantkit.prepared_linear.default" in seen
    torch.testing.assert_close(y, step(x), rtol=0, atol=0)
    assert y.shape == (3, 64) and y.dtype == x.dtype


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import quantkit.fused_kernels.triton.w4a16 as T

    def compile(kernel, pointers, constants, **options):
        sig = {n: "constexpr" if n in constants else pointers.get(n, "i32")
               for n in kernel.arg_names}
        triton.compile(ASTSource(kernel, sig, constants), target=GPUTarget("cuda", 90, 32),
                       options=options)

    acts = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", zp_ptr="*i32")
    for block_m, unpack in ((1, 0), (1, 1), (1, 2), (4, 1), (16, 0)):
        compile(T._w4a16_gemv_kernel, dict(acts, y_ptr="*fp32"),
                dict(HAS_ZP=True, DOT_PRECISION="ieee", BLOCK_M=block_m, BLOCK_N=64,
                     BLOCK_K=128, SPLIT_K=4, UNPACK=unpack, STEP_GROUPS=1))
    compile(T._w4a16_gemv_kernel, dict(acts, y_ptr="*fp32"),
            dict(HAS_ZP=True, DOT_PRECISION="ieee", BLOCK_M=1, BLOCK_N=16, BLOCK_K=1024,
                 SPLIT_K=4, UNPACK=1, STEP_GROUPS=8), num_warps=8, num_stages=1)
    compile(T._w4a16_gemm_kernel, dict(acts, b_ptr="*bf16", y_ptr="*bf16"),
            dict(HAS_ZP=False, HAS_BIAS=True, DOT_PRECISION="ieee", BLOCK_M=64, BLOCK_N=128,
                 BLOCK_K=32, GROUP_M=8), num_warps=4, num_stages=4)
    import quantkit.fused_kernels.triton.w4a16_columns as C
    for has_zp, split in ((True, 16), (False, 1)):
        compile(C._w4a16_columns_kernel,
                dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", z_ptr="*fp32", y_ptr="*fp32"),
                dict(HAS_ZP=has_zp, BLOCK_N=256, BLOCK_W=8, SPLIT_K=split, WAVES=4),
                num_warps=4, num_stages=4)
    print("compiled for sm_90")
    """
)


@pytest.mark.skipif(IN_CHILD, reason="runs once, in the parent")
def test_kernels_compile_for_hopper(tmp_path) -> None:
    """Lower the GEMV and GEMM to sm_90 machine code without a GPU (Triton ships ptxas): type
    or lowering errors the interpreter cannot see show up here, on any machine."""
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
    import torch
    from quantkit.format.packing import dequantize_packed_int4
    from quantkit.fused_kernels.packed_weights import PackedInt4
    from quantkit.fused_kernels.triton.w4a16 import is_interpreted, w4a16_linear_triton
    from quantkit.fused_kernels.triton.w4a16_columns import TritonInt4Layer
    from quantkit.format.packing import int4_qparams, int4_quantize, pack_int4, pack_zero_points

    assert not is_interpreted()
    # error / sum |x| |W|: weight rounding to the activation dtype (half an ulp) plus output
    # rounding, with a 2x margin; fp32 uses input_precision="ieee" (no TF32).
    tols = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    for m, n, k, g, sym in [(1, 4096, 4096, 128, False), (7, 200, 384, 64, True),
                            (16, 576, 1536, 32, False), (300, 1536, 576, 64, False),
                            (33, 77, 200, -1, False), (2048, 4096, 4096, 128, False),
                            (1, 77, 200, -1, True), (1, 14336, 4096, 128, False),
                            (1, 4096, 14336, 32, True)]:
        gs = k if g == -1 else g
        w = torch.randn(n, k)
        s, z = int4_qparams(w, group_size=gs, symmetric=sym)
        q = int4_quantize(w, s, z, group_size=gs)
        t = [pack_int4(q).cuda(), s.cuda(), None if z is None else pack_zero_points(z).cuda()]
        wd = dequantize_packed_int4(*t, in_features=k, group_size=gs)
        for dt, tol in tols.items():
            x = torch.randn(m, k, device="cuda").to(dt)
            ys = [w4a16_linear_triton(x, PackedInt4(*t, k, g)).float()]
            if m == 1:  # the triton layer's own path for one row: the column GEMV
                ys.append(TritonInt4Layer(PackedInt4(*t, k, g))(x).float())
            ref = x.double() @ wd.double().T
            mag = (x.double().abs() @ wd.double().abs().T).max()
            for path, y in enumerate(ys):
                err = ((y.double() - ref).abs().max() / mag).item()
                assert err < tol, (m, n, k, g, sym, dt, path, err)
    print("gpu sweep ok")
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_on_gpu_matches_reference() -> None:
    """Compiled kernels on CUDA (fp16, bf16, fp32; autotuned), in a fresh process so that the
    interpreter-mode module of this file's other tests is not the one under test."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu sweep ok" in proc.stdout

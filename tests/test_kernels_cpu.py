"""CPU W4A16 backend (compiled C GEMV + dequantize/MKL prefill) against the reference.

Every instruction-set variant this CPU runs (avx512, avx2, generic C) is built into a temporary
$QUANTKIT_HOME and swept over odd shapes: N not a multiple of 8 (half-used zero-point words),
per-channel K not a multiple of 8 or 32 (a partial last block), M = 1..5 (the 4-row chunking and
its remainders), M = 16 and M = 33 (the prefill path), every activation and scale dtype, bias.
"""

from __future__ import annotations

import pytest
import torch

import quantkit.fused_kernels.cpu.w4a16 as cpu
from quantkit.errors import KernelUnavailableError
from quantkit.format.packing import (
    dequantize_packed_int4,
    int4_qparams,
    int4_quantize,
    pack_int4,
    pack_zero_points,
)
from quantkit.fused_kernels.cpu.build import build_library, supported_variants
from quantkit.fused_kernels.packed_weights import PackedInt4
from quantkit.fused_kernels.reference.w4a16 import w4a16_linear_reference

VARIANTS = supported_variants()


@pytest.fixture(scope="module", autouse=True)
def kernel_home(tmp_path_factory: pytest.TempPathFactory):
    """Build the kernels into a temporary QUANTKIT_HOME (and forget the loaded ones after)."""
    mp = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("quantkit-home")
    mp.setenv("QUANTKIT_HOME", str(home))
    cpu._library.cache_clear()
    yield home
    cpu._library.cache_clear()
    mp.undo()


def make_layer(n: int, k: int, group: int, symmetric: bool, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    g = k if group == -1 else group
    scale, zero = int4_qparams(w, group_size=g, symmetric=symmetric)
    codes = int4_quantize(w, scale, zero, group_size=g)
    zp = None if zero is None else pack_zero_points(zero)
    return pack_int4(codes), scale.to(dtype), zp, g


def tolerances(x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """The kernel computes in fp32 like the reference (x and scales upcast exactly), summing in
    another order: ~sqrt(K) * 6e-8 of sum |x| |w| (2.3e-6 at K=1536); 1e-5 of it is the margin,
    while one wrong nibble moves an output by >= 1/K of it. bf16/fp16 outputs are then rounded
    once on each side, so two values 1e-5 apart may round one ulp apart: rtol of one ulp."""
    magnitude = (x.float().abs() @ w.abs().T).max().item()
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[x.dtype]
    return dict(atol=1e-5 * magnitude, rtol=rtol)


CASES = [
    # m, n, k, group, symmetric, x dtype, scale dtype, bias
    (1, 64, 128, 32, False, torch.float32, torch.float32, False),
    (1, 77, 384, 128, False, torch.bfloat16, torch.bfloat16, True),
    (2, 200, 384, 64, True, torch.float16, torch.float16, True),
    (3, 9, 200, -1, False, torch.float32, torch.bfloat16, False),
    (4, 576, 1536, 64, False, torch.bfloat16, torch.bfloat16, False),
    (5, 13, 13, -1, True, torch.float32, torch.float32, True),
    (1, 33, 14336, 128, False, torch.float32, torch.float16, False),
    (16, 40, 576, 32, False, torch.float16, torch.float32, True),
    (7, 1, 9000, -1, False, torch.float32, torch.float32, False),
    (33, 50, 256, 64, True, torch.bfloat16, torch.bfloat16, True),
    (64, 9, 96, 32, False, torch.float32, torch.float32, False),
    # row chunks of 8 (AVX-512), then the 5-7 left as one chunk, else chunks of <= 4:
    # 8, 8 + 3, 8 + 5, 6, 8 + 7
    (6, 70, 384, 64, False, torch.float32, torch.float32, True),
    (15, 33, 640, 128, True, torch.float32, torch.bfloat16, False),
    (8, 576, 1536, 64, False, torch.float32, torch.bfloat16, False),
    (11, 70, 384, -1, True, torch.float32, torch.float32, True),
    (13, 33, 640, 128, False, torch.bfloat16, torch.bfloat16, False),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-N{}-K{}-g{}-{}-{}".format(*c[:5], c[5]))
def test_cpu_matches_reference(variant: str, case: tuple, monkeypatch) -> None:
    # fp32 math throughout (the bf16-matmul prefill has its own test and tolerance)
    monkeypatch.setattr(cpu, "has_bf16_matmul", lambda: False)
    m, n, k, group, symmetric, dtype, scale_dtype, with_bias = case
    wp, scale, zp, g = make_layer(n, k, group, symmetric, dtype=scale_dtype, seed=m)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    weights = PackedInt4(wp, scale, zp, k, g)
    y = cpu.w4a16_linear_cpu(x, weights, bias=bias, variant=variant)
    ref = w4a16_linear_reference(x.float(), weights, bias=None if bias is None else bias.float())
    w = dequantize_packed_int4(wp, scale, zp, in_features=k, group_size=g)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref.to(dtype).float(), **tolerances(x, w))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_dtype_conversions_are_exact(variant: str, dtype: torch.dtype) -> None:
    """Identity-like weights make every fp32 operation exact, so the output must equal torch's
    own rounding bit for bit: half/bf16 reads (x, scales, bias incl. subnormals) and the
    round-to-nearest-even stores (ties, overflow to inf)."""
    n = k = 64
    codes = torch.eye(n, k, dtype=torch.int8)  # W[n, n] = (1 - 0) * s[n]
    finfo = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(0)
    scale = (torch.rand(n, 1, generator=gen) * 4).to(dtype)
    scale[0] = finfo.tiny / 4  # a subnormal scale (fp16) / a tiny one (bf16)
    scale[1] = 1.0
    x = torch.randn(3, k, generator=gen).to(dtype)
    x[0, 1] = finfo.max  # with bias: overflows to inf on rounding
    x[1, 2] = finfo.tiny / 8  # a subnormal activation; its output is subnormal or zero
    bias = torch.randn(n, generator=gen).to(dtype)
    bias[1] = finfo.max
    bias[2] = 0.0
    weights = PackedInt4(pack_int4(codes), scale, None, k, k)
    y = cpu.w4a16_linear_cpu(x, weights, bias=bias, variant=variant)
    expected = (x.float() * scale.float().T + bias.float()).to(dtype)
    assert torch.equal(y, expected)


@pytest.mark.parametrize("n,k,group,symmetric", [(77, 384, 128, False), (9, 200, -1, True)])
def test_cpu_dequantize_is_bit_exact(n: int, k: int, group: int, symmetric: bool) -> None:
    wp, scale, zp, g = make_layer(n, k, group, symmetric, dtype=torch.bfloat16)
    w = cpu.dequantize_cpu(wp, scale, zp, in_features=k)
    assert torch.equal(w, dequantize_packed_int4(wp, scale, zp, in_features=k, group_size=g))


def test_cpu_handles_views_and_leading_dims() -> None:
    wp, scale, zp, g = make_layer(40, 256, 64, False)
    x = torch.randn(256, 6).T.reshape(2, 3, 256)  # non-contiguous input, 3-D
    weights = PackedInt4(wp, scale, zp, 256, g)
    y = cpu.w4a16_linear_cpu(x, weights)
    ref = w4a16_linear_reference(x, weights)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    assert cpu.w4a16_linear_cpu(x[:0], weights).shape == (0, 3, 40)


def test_cpu_rejects_bad_inputs() -> None:
    wp, scale, zp, g = make_layer(40, 256, 64, False)
    weights = PackedInt4(wp, scale, zp, 256, g)
    with pytest.raises(KernelUnavailableError, match="got torch.float64"):
        cpu.w4a16_linear_cpu(torch.randn(1, 256, dtype=torch.float64), weights)
    with pytest.raises(ValueError, match=r"expected 32 words per row .* got 31"):
        cpu.w4a16_linear_cpu(torch.randn(1, 256), PackedInt4(wp[:, :31], scale, zp, 256, g))
    with pytest.raises(ValueError, match=r"weight_zero_point: expected int32 \[5, 4\]"):
        cpu.w4a16_linear_cpu(torch.randn(1, 256), PackedInt4(wp, scale, zp[:4], 256, g))
    with pytest.raises(ValueError, match=r"bias: expected a float \[40\] tensor"):
        cpu.w4a16_linear_cpu(torch.randn(1, 256), weights, bias=torch.ones(41))
    # groups of 16 are valid quantization but not a layout the C kernel takes
    wp16, scale16, zp16, _ = make_layer(40, 256, 16, False)
    with pytest.raises(ValueError, match="multiple of 32 or per-channel"):
        cpu.w4a16_linear_cpu(torch.randn(1, 256), PackedInt4(wp16, scale16, zp16, 256, 16))


def test_build_is_cached_and_keyed(kernel_home) -> None:
    source = "int qk_answer(void) { return 42; }\n"
    first = build_library("qk_test", source, variant="generic")
    assert first.parent == kernel_home / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build_library("qk_test", source, variant="generic") == first
    assert first.stat().st_mtime_ns == mtime  # not rebuilt
    other = build_library("qk_test", source + "\n", variant="generic")
    assert other != first  # another source, another file
    assert not list((kernel_home / "kernels").glob(".qk_test-*"))  # no temporary dirs left


def test_missing_compiler_is_a_typed_error(monkeypatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-qk")
    with pytest.raises(KernelUnavailableError, match="expected a C compiler.*no-such-compiler-qk"):
        build_library("qk_test_cc", "int f(void) { return 1; }\n", variant="generic")


def test_broken_source_is_a_typed_error() -> None:
    with pytest.raises(KernelUnavailableError, match="to build qk_bad"):
        build_library("qk_bad", "this is not C\n", variant="generic")


def test_unknown_variant_is_rejected() -> None:
    with pytest.raises(KernelUnavailableError, match="cpu variant: expected one this CPU runs"):
        build_library("qk_test", "int f(void) { return 1; }\n", variant="avx9000")


@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_prefill_path_matches_reference(variant: str, monkeypatch) -> None:
    """Dequantize + MKL (taken above GEMV_MAX_M rows; forced here with a threshold of 0)."""
    monkeypatch.setattr(cpu, "GEMV_MAX_M", dict.fromkeys(cpu.GEMV_MAX_M, 0))
    for m, n, k, group, symmetric in [(3, 77, 384, 128, False), (20, 9, 200, -1, True)]:
        wp, scale, zp, g = make_layer(n, k, group, symmetric, dtype=torch.bfloat16)
        x = torch.randn(m, k)
        bias = torch.randn(n)
        weights = PackedInt4(wp, scale, zp, k, g)
        y = cpu.w4a16_linear_cpu(x, weights, bias=bias, variant=variant)
        ref = w4a16_linear_reference(x, weights, bias=bias)
        # the same fp32 weights and MKL matmul as the reference: equal up to MKL's blocking
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-5)


def test_cpu_bf16_prefill_path(monkeypatch) -> None:
    """bf16 activations above GEMV_MAX_M_BF16 rows on a CPU with bf16 matmuls: the weights are
    rounded to bf16 (half an ulp, 2^-9 relative: at worst 2^-9 of sum |x| |w|) and the output
    is rounded to bf16 (and again after the bias): atol 2^-8 of sum |x| |w|, rtol 2^-7."""
    monkeypatch.setattr(cpu, "has_bf16_matmul", lambda: True)
    wp, scale, zp, g = make_layer(300, 576, 64, False, dtype=torch.bfloat16)
    x = torch.randn(40, 576).to(torch.bfloat16)
    bias = torch.randn(300).to(torch.bfloat16)
    weights = PackedInt4(wp, scale, zp, 576, g)
    y = cpu.w4a16_linear_cpu(x, weights, bias=bias)
    ref = w4a16_linear_reference(x.float(), weights, bias=bias.float())
    w = dequantize_packed_int4(wp, scale, zp, in_features=576, group_size=g)
    magnitude = (x.float().abs() @ w.abs().T).max().item()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=2.0**-8 * magnitude, rtol=2.0**-7)


def _bf16_weights(wp, scale, zp, *, n: int, k: int, g: int) -> torch.Tensor:
    """The weights the bf16 tile multiplies: u * s + c in one fp32 rounding (an FMA; u the
    stored nibble, c = -(stored zero nibble) * s in fp32, as `tile_params` makes it), then
    rounded to bf16."""
    from quantkit.format.packing import unpack_int4, unpack_zero_points

    u = unpack_int4(wp, k).double() + 8
    s = scale.float()
    raw = 8 if zp is None else unpack_zero_points(zp, n).float() + 8
    c = -(raw * s)  # fp32, as the kernel
    s64, c64 = (t.double().repeat_interleave(g, dim=1)[:, :k] for t in (s, c))
    return (u * s64 + c64).float().bfloat16()


BF16_CASES = [
    # m, n, k, group, symmetric: row chunks 8, 8 + 3, 8 + 5, 32 + 8, 5, 6, 8 + 7; an odd last
    # weight row
    (1, 64, 128, 32, False),
    (5, 64, 256, 64, False),
    (6, 77, 384, 128, True),
    (15, 70, 384, 64, False),
    (3, 77, 384, 128, True),
    (8, 576, 1536, 64, False),
    (11, 70, 384, 64, False),
    (13, 33, 640, 128, False),
    (40, 9, 96, 32, True),
]


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: "M{}-N{}-K{}-g{}-sym{}".format(*c))
def test_cpu_bf16_activations_sum_bf16_operands_in_fp32(case: tuple) -> None:
    """bf16_activations=True: x and the dequantized weights each rounded to bf16 (the operands
    vdpbf16ps takes), their exact products summed in fp32: equal to an fp64 sum of the same
    products within the fp32-summation tolerance, and measurably unlike the fp32 GEMV."""
    from quantkit.fused_kernels.cpu.decode import bf16_activations_available

    if not bf16_activations_available():
        pytest.skip("bf16 activations need a CPU with AVX512-BF16")
    m, n, k, group, symmetric = case
    wp, scale, zp, g = make_layer(n, k, group, symmetric, dtype=torch.bfloat16, seed=m)
    layer = cpu.CpuInt4Layer(PackedInt4(wp, scale, zp, k, g))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    y = layer(x, bf16_activations=True)
    w = _bf16_weights(wp, scale, zp, n=n, k=k, g=g)
    ref = (x.bfloat16().double() @ w.double().T).float()
    tol = tolerances(x, w.float())
    torch.testing.assert_close(y, ref, **tol)
    assert (layer(x) - y).abs().max() > tol["atol"]  # the fp32 GEMV: not the same operands


def test_cpu_bf16_activations_fall_back_to_fp32_where_groups_do_not_fit() -> None:
    """Per-channel (K not a power-of-two number of blocks) keeps fp32 activations: the same
    result as the fp32 GEMV, bit for bit."""
    wp, scale, zp, g = make_layer(20, 200, -1, False)
    layer = cpu.CpuInt4Layer(PackedInt4(wp, scale, zp, 200, g))
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x, bf16_activations=True), layer(x))


def _int8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the int8 tile sees it: each row's blocks quantized on their own, t = absmax / 127,
    q = round(x * (1 / t)) (ties to even), then t * q. A block is the largest of 128, 64 and 32
    elements dividing the group (the row, per channel) and the row."""
    m, k = x.shape
    group = k if group == -1 else group
    block = next(a for a in (128, 64, 32) if group % a == 0 and k % a == 0)
    blocks = x.view(m, k // block, block)
    t = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(t > 0, 1 / t, torch.zeros_like(t))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q * t).view(m, k)


# (M, N, K, group, symmetric): chunks that split groups (g32, g64), groups spanning chunks
# (g256), K not a multiple of 128 (a half chunk: SmolLM2's 576), per channel, the row chunks.
INT8_CASES = [
    (1, 64, 128, 32, False),
    (1, 576, 576, 64, False),
    (3, 70, 384, 64, True),
    (8, 96, 1536, 64, False),
    (5, 33, 512, 256, False),
    (2, 40, 576, -1, False),
    (11, 24, 640, 128, True),
    (3, 20, 384, 96, False),  # blocks of 32 inside groups of 96
    # 16 rows and more: the prefill tile, two 16-row tiles a call, 6 activation rows a chunk
    (17, 70, 576, 64, False),  # 5 tiles: two pairs and one alone; chunks of 6, 6 and 5
    (40, 48, 1536, 128, True),
    (16, 33, 512, 256, False),
    (23, 40, 576, -1, False),
    (19, 32, 384, 96, False),
]


@pytest.mark.parametrize("case", INT8_CASES, ids=lambda c: "M{}-N{}-K{}-g{}-sym{}".format(*c))
def test_cpu_int8_activations_multiply_the_quantized_rows(case: tuple) -> None:
    """int8_activations=True: each row quantized per block (`_int8_rows`) times the
    dequantized weights, equal to an fp64 product of the same operands within the
    fp32-summation tolerance, and measurably unlike the fp32 GEMV."""
    from quantkit.fused_kernels.cpu.decode import int8_activations_available

    if not int8_activations_available():
        pytest.skip("int8 activations need a CPU with AVX512-VNNI")
    m, n, k, group, symmetric = case
    wp, scale, zp, g = make_layer(n, k, group, symmetric, seed=m)
    layer = cpu.CpuInt4Layer(PackedInt4(wp, scale, zp, k, g))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)) * 3
    x[0, 5] = 40.0  # an outlier: its chunk gets a coarser step
    y = layer(x, int8_activations=True)
    w = dequantize_packed_int4(wp, scale, zp, in_features=k, group_size=g).float()
    ref = (_int8_rows(x, group).double() @ w.double().T).float()
    tol = tolerances(x, w)
    torch.testing.assert_close(y, ref, **tol)
    assert (layer(x) - y).abs().max() > tol["atol"]  # the fp32 GEMV: not the same operands


def test_cpu_int8_tile_rows_do_not_depend_on_the_others() -> None:
    """The 16-row int8 tile sums integers per block, so a row's result is the same bits in a
    call of 1, 3, 6 or 8 rows (the chunks take 1, 2 and 4 accumulators a row) and in the
    prefill tile's calls of 16 rows and more (tiles in pairs, 4 pairs a unit over groups of 4
    chunks of 6 rows, the last shorter), and the interleaved copy is the packed words
    transposed per 16 rows (70 rows: a padded tile)."""
    from quantkit.fused_kernels.cpu.decode import int8_activations_available

    if not int8_activations_available():
        pytest.skip("int8 activations need a CPU with AVX512-VNNI")
    # g128 too: its 128-element blocks take the prefill tile's unrolled loop; 176 rows: 11
    # tiles, a unit of 4 pairs, one of 1 and a tile alone, over 53 rows (groups of 24, 24, 5)
    for n, k, group in ((70, 576, 64), (70, 1536, 128), (176, 576, 64)):
        wp, scale, zp, g = make_layer(n, k, group, False, seed=4)
        layer = cpu.CpuInt4Layer(PackedInt4(wp, scale, zp, k, g))
        x = torch.randn(53, k, generator=torch.Generator().manual_seed(5))
        alone = torch.cat([layer(x[i : i + 1], int8_activations=True) for i in range(53)])
        for m in (3, 6, 8, 16, 17, 23, 53):
            assert torch.equal(layer(x[:m], int8_activations=True), alone[:m]), (n, group, m)
    wp, scale, zp, g = make_layer(70, 576, 64, False, seed=4)
    layer = cpu.CpuInt4Layer(PackedInt4(wp, scale, zp, 576, g))
    layer(x[:1, :576], int8_activations=True)
    words = layer._rows16[0]
    assert tuple(words.shape) == (5, 72, 16) and torch.equal(words[1, :, 3], wp[19])
    assert torch.equal(words[4, :, 6:], torch.zeros(72, 10, dtype=torch.int32))


def test_cpu_int8_activations_fall_back_to_fp32_where_groups_do_not_fit() -> None:
    """One group per row of 200 elements (no block of 32 divides it): fp32 activations, bit
    for bit the fp32 GEMV, and no interleaved copy made."""
    wp, scale, zp, g = make_layer(20, 200, -1, False)
    layer = cpu.CpuInt4Layer(PackedInt4(wp, scale, zp, 200, g))
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x, int8_activations=True), layer(x))
    assert not layer.interleave() and layer._rows16 is None


@pytest.mark.parametrize("case", [(1, 70, 576, 64), (8, 96, 1536, 64), (3, 41, 256, 32)])
def test_cpu_layer_byte_zero_points_match_the_packed_ones_bit_for_bit(case: tuple) -> None:
    """The bound layer reads its zero points one byte each (`qk_w4_layer.zq`, unpacked once at
    binding); the unbound call reads the packed words. Same constants, so the same bits, with
    fp32 and with int8 activations; and the bytes are the stored nibbles."""
    from quantkit.format.packing import unpack_zero_points
    from quantkit.fused_kernels.cpu.decode import int8_activations_available

    m, n, k, group = case
    wp, scale, zp, g = make_layer(n, k, group, symmetric=False, seed=m)
    layer = cpu.CpuInt4Layer(PackedInt4(wp, scale, zp, k, g))
    assert torch.equal(layer._zq.long(), unpack_zero_points(zp, n).long() + 8)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    assert torch.equal(layer(x), cpu.w4a16_linear_cpu(x, PackedInt4(wp, scale, zp, k, g)))
    if int8_activations_available():  # the int8 tile reads the same constants
        wrong = cpu.CpuInt4Layer(PackedInt4(wp, scale, zp, k, g))
        wrong._zq.copy_(torch.where(wrong._zq > 0, wrong._zq - 1, wrong._zq + 1))
        assert not torch.equal(wrong(x, int8_activations=True), layer(x, int8_activations=True))

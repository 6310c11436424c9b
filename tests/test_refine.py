"""Coordinate descent on INT4 codes and scales after GPTQ (`quantize/refine.py`)."""

from __future__ import annotations

import pytest
import torch

from quantkit.format.packing import INT4_MAX, INT4_MIN, int4_qparams
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.gptq import GptqConfig, gptq_weight, output_error
from quantkit.quantize.refine import _codes_pass, refine_int4


def _layer(n: int = 24, k: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    # Correlated inputs (a shared factor), as real activations are: H far from diagonal.
    x = torch.randn(512, k, generator=gen) + 2 * torch.randn(512, 1, generator=gen)
    return w, 2 * x.T @ x / 512


@pytest.mark.parametrize("symmetric", [False, True])
def test_refined_codes_lower_the_output_error_to_a_local_minimum(symmetric: bool) -> None:
    w, h = _layer()
    scheme = QuantScheme("int4", group_size=32, symmetric=symmetric)
    q, rounder = gptq_weight(w, h, scheme=scheme, cfg=GptqConfig(refine=0))
    refined, scale = refine_int4(
        w, q, h, scale=rounder.scale, zero=rounder.zero, group_size=32, passes=50
    )
    rounder.scale = scale
    before, after = output_error(w, q, h), output_error(w, refined, h)
    assert after < 0.99 * before  # GPTQ's greedy pass leaves codes a revisit improves
    codes = rounder.codes(refined)
    assert int(codes.min()) >= INT4_MIN and int(codes.max()) <= INT4_MAX
    assert torch.equal(rounder.stored(refined), refined)  # codes on the stored scales
    # Converged: no single code moved one step lowers the error any more.
    for n, j in [(0, 0), (3, 17), (23, 63), (11, 40)]:
        for d in (1, -1):
            moved = refined.clone()
            step = d * float(rounder.scale[n, j // 32])
            code = int(codes[n, j]) + d
            if INT4_MIN <= code <= INT4_MAX:
                moved[n, j] += step
                assert output_error(w, moved, h) >= output_error(w, refined, h) - 1e-9


def test_no_pass_changes_nothing_and_the_config_runs_it() -> None:
    w, h = _layer(seed=1)
    scheme = QuantScheme("int4", group_size=32)
    q, rounder = gptq_weight(w, h, scheme=scheme, cfg=GptqConfig(refine=0))
    same, scale = refine_int4(
        w, q, h, scale=rounder.scale, zero=rounder.zero, group_size=32, passes=0
    )
    assert torch.equal(same, q) and torch.equal(scale, rounder.scale)
    refined, _ = gptq_weight(w, h, scheme=scheme, cfg=GptqConfig(refine=2))
    assert output_error(w, refined, h) < output_error(w, q, h)
    with pytest.raises(ValueError, match="passes: expected >= 0, got -1"):
        refine_int4(w, q, h, scale=rounder.scale, zero=rounder.zero, group_size=32, passes=-1)


def _reference_codes_pass(
    codes: torch.Tensor, s: torch.Tensor, g: torch.Tensor, h: torch.Tensor
) -> int:
    """The plain per-column sweep (the first implementation): each column's codes stepped where
    that lowers the error, then all of g updated by the column's rank-1 change."""
    n, k = codes.shape
    diag = h.diagonal()
    moved = 0
    for j in range(k):
        if diag[j] <= 0:
            continue
        sj = s[:, j]
        best = torch.zeros(n, dtype=h.dtype)
        step = torch.zeros(n, dtype=h.dtype)
        for d in (1.0, -1.0):
            ok = (codes[:, j] + d >= INT4_MIN) & (codes[:, j] + d <= INT4_MAX)
            delta = -2.0 * d * sj * g[:, j] + sj * sj * diag[j]
            take = ok & (delta < best)
            best = torch.where(take, delta, best)
            step = torch.where(take, torch.full_like(step, d), step)
        if bool(step.any()):
            moved += int(step.ne(0).sum())
            codes[:, j] += step
            g -= (step * sj)[:, None] * h[j][None, :]
    return moved


def _reference_scales_pass(
    codes: torch.Tensor,
    z: torch.Tensor,
    scale: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype,
) -> None:
    """The first implementation's scale pass: all of g updated by every group's steps."""
    k = codes.shape[1]
    for grp in range(scale.shape[1]):
        cols = slice(grp * group_size, min(k, (grp + 1) * group_size))
        a = codes[:, cols] - z[:, cols]
        denom = ((a @ h[cols, cols]) * a).sum(1)
        along = (a * g[:, cols]).sum(1)
        want = scale[:, grp] + torch.where(denom > 0, along / denom, 0.0)
        new = want.to(dtype).to(h.dtype)
        delta = new - scale[:, grp]
        change = -2.0 * delta * along + delta * delta * denom
        delta = torch.where((change < 0) & (new > 0), delta, torch.zeros_like(delta))
        scale[:, grp] += delta
        g -= (delta[:, None] * a) @ h[cols, :]


def _realistic_layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] and H = 2 X^T X / T, damped by 1% of its mean diagonal, of inputs correlated
    (mixed channels and a shared factor) with uneven channel scales, both fp64."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    w = torch.randn(n, k, generator=gen, dtype=f64)
    mix = torch.eye(k, dtype=f64) + torch.randn(k, k, generator=gen, dtype=f64) / k**0.5
    x = torch.randn(4 * k, k, generator=gen, dtype=f64) @ mix
    x = x + 2 * torch.randn(4 * k, 1, generator=gen, dtype=f64)
    x = x * (0.2 + 3 * torch.rand(k, generator=gen, dtype=f64))
    h = 2 * x.T @ x / x.shape[0]
    return w, h + 0.01 * h.diagonal().mean() * torch.eye(k, dtype=f64)


@pytest.mark.parametrize(("k", "block"), [(200, 64), (200, 128), (128, 32), (96, 500)])
def test_blocked_codes_pass_is_the_per_column_sweep(k: int, block: int) -> None:
    """`_codes_pass` (columns in blocks: K a multiple of the block or not, or one block wider
    than K) against the plain per-column sweep, three passes from RTN's codes (many to move):
    the same codes (>= 99.9%: the arithmetic is the sweep's, only a rounding tie could differ)
    and moves, the same objective to 1e-9, and g consistent with the codes it comes back with."""
    w, h = _realistic_layer(48, k, seed=k + block)
    scale, _ = int4_qparams(w, group_size=8, symmetric=True)
    s = scale.double().repeat_interleave(8, dim=1)
    codes = torch.round(w / s).clamp(INT4_MIN, INT4_MAX)  # symmetric: Q = codes * s

    def objective(c: torch.Tensor) -> float:
        e = w - c * s
        return float(((e @ h) * e).sum())

    ref_codes, new_codes = codes.clone(), codes.clone()
    ref_g = (w - codes * s) @ h
    new_g = ref_g.clone()
    ref_moved = new_moved = 0
    for _ in range(3):
        ref_moved += _reference_codes_pass(ref_codes, s, ref_g, h)
        new_moved += _codes_pass(new_codes, s, new_g, h, block=block)
    assert ref_moved > k  # a real workload: several moves per column
    assert (new_codes == ref_codes).double().mean() >= 0.999
    assert abs(new_moved - ref_moved) <= 3 * int((new_codes != ref_codes).sum())
    ref_after, new_after = objective(ref_codes), objective(new_codes)
    assert new_after < objective(codes)
    assert abs(new_after - ref_after) <= 1e-9 * ref_after
    exact = (w - new_codes * s) @ h
    assert torch.allclose(new_g, exact, rtol=0, atol=1e-9 * float(exact.abs().max()))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_refine_matches_the_per_column_passes(scale_dtype: torch.dtype) -> None:
    """`refine_int4` against the same passes run with the reference sweeps, after GPTQ on a
    layer whose K (224, groups of 32) is not a multiple of the block: the same codes and scales
    (>= 99.9%) and the same objective to 1e-9. With bf16 scales only some rows' scales move and
    the scale pass updates only those rows' g; with fp32 nearly all do."""
    w64, h64 = _realistic_layer(40, 224, seed=3)
    w, h = w64.float(), h64.float()
    scheme = QuantScheme("int4", group_size=32)
    q, rounder = gptq_weight(w, h, scheme=scheme, scale_dtype=scale_dtype, cfg=GptqConfig(refine=0))
    refined, scale = refine_int4(
        w, q, h, scale=rounder.scale, zero=rounder.zero, group_size=32, passes=4,
        scale_dtype=scale_dtype,
    )  # fmt: skip

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.double().repeat_interleave(32, dim=1)

    ref_scale = rounder.scale.double().clone()
    z = per_column(rounder.zero)
    codes = torch.round(q.double() / per_column(ref_scale) + z)
    hd = h.double()
    g = (w.double() - (codes - z) * per_column(ref_scale)) @ hd
    for _ in range(4):
        _reference_codes_pass(codes, per_column(ref_scale), g, hd)
        _reference_scales_pass(codes, z, ref_scale, g, hd, group_size=32, dtype=scale_dtype)
    reference = ((codes - z) * per_column(ref_scale)).float()
    assert (refined == reference).double().mean() >= 0.999
    assert (scale == ref_scale.float()).double().mean() >= 0.999
    ref_error, new_error = output_error(w, reference, h), output_error(w, refined, h)
    assert new_error < output_error(w, q, h)
    assert abs(new_error - ref_error) <= 1e-9 * ref_error

"""Coordinate descent on INT4 codes and scales after GPTQ (`quantize/refine.py`)."""

from __future__ import annotations

import pytest
import torch

from quantkit.format.packing import INT4_MAX, INT4_MIN
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.gptq import GptqConfig, gptq_weight, output_error
from quantkit.quantize.refine import refine_int4


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
    q, rounder = gptq_weight(w, h, scheme=scheme)
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
    q, rounder = gptq_weight(w, h, scheme=scheme)
    same, scale = refine_int4(
        w, q, h, scale=rounder.scale, zero=rounder.zero, group_size=32, passes=0
    )
    assert torch.equal(same, q) and torch.equal(scale, rounder.scale)
    refined, _ = gptq_weight(w, h, scheme=scheme, cfg=GptqConfig(refine=2))
    assert output_error(w, refined, h) < output_error(w, q, h)
    with pytest.raises(ValueError, match="passes: expected >= 0, got -1"):
        refine_int4(w, q, h, scale=rounder.scale, zero=rounder.zero, group_size=32, passes=-1)

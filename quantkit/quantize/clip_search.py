"""Per-group clipping of INT4 scales, searched on a grid: what GPTQ's scales may shrink to.

Round to nearest takes each group's range from its min and max, so one outlier sets the step for
the whole group. Shrinking the range by a ratio r (`int4_qparams(clip_ratio=r)`) clamps the
outliers and rounds the rest finer. Each (output row, group) takes the r in
[`max_shrink`, 1] (`steps` + 1 evenly spaced values, 1 included, so never worse than min/max on
the measured error) that minimises its round-to-nearest error:

- `mse`: the weights' own squared error, sum_j (W - Q)_j^2 over the group's columns (GPTQ's
  reference `Quantizer(mse=True)` with norm 2);
- `output`: the group's share of the Linear's output error on the calibration inputs,
  d_g H_gg d_g^T with d = W - Q and H_gg the group's diagonal block of the Hessian H = 2 X^T X /
  tokens: AWQ's clip objective (`awq._search_clip`), on every calibration token instead of a
  sample, read from the Hessian GPTQ captures anyway.

The error is round to nearest's, not GPTQ's (which moves each column's error onto the next):
a proxy that is cheap, a few grid points per weight, and measured in
`evals/studies/int4_recipes.py`.
"""

from __future__ import annotations

import torch

from quantkit.format.packing import fake_quantize_int4

CLIP_MODES = ("none", "mse", "output")


def _diagonal_blocks(h: torch.Tensor, group: int) -> torch.Tensor:
    """H [K, K] -> its diagonal blocks [K/G, G, G]."""
    k = h.shape[0]
    n = k // group
    return h.reshape(n, group, n, group).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def clip_ratios(
    w: torch.Tensor,
    *,
    group_size: int,
    symmetric: bool,
    mode: str,
    h: torch.Tensor | None = None,
    steps: int = 50,
    max_shrink: float = 0.5,
) -> torch.Tensor:
    """The clip ratio [N, K/G] per (row, group) of W [N, K] minimising `mode`'s error (module
    docstring); `h` [K, K] is needed for `output`. Ties keep the larger ratio."""
    if mode not in CLIP_MODES[1:]:
        raise ValueError(f"clip mode: expected one of {', '.join(CLIP_MODES[1:])}, got {mode!r}")
    if mode == "output" and h is None:
        raise ValueError("clip mode output: expected the Hessian h, got None")
    n, k = w.shape
    g = k if group_size == -1 else group_size
    w = w.float()
    blocks = None if h is None or mode != "output" else _diagonal_blocks(h.float(), g)
    best_err = torch.full((n, k // g), float("inf"), device=w.device)
    best = torch.ones(n, k // g, device=w.device)
    with torch.no_grad():
        for i in range(steps + 1):
            ratio = 1 - i * (1 - max_shrink) / steps
            wq = fake_quantize_int4(w, group_size=g, symmetric=symmetric, clip_ratio=ratio)
            d = (wq - w).view(n, k // g, g)
            if blocks is None:
                err = d.pow(2).sum(-1)
            else:
                err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, torch.full_like(best, ratio), best)
    return best

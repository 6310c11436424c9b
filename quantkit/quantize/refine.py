"""Block coordinate descent after GPTQ on INT4: the codes, then the group scales, each chosen
to lower the layer's output error tr((W - Q) H (W - Q)^T), `passes` times.

GPTQ visits each column once and never returns: a code chosen early is not revisited once the
later columns have absorbed its error, and the scales stay RTN's (clipped) ones whatever codes
end up on them. Each pass here:

- moves every code one step up or down where that lowers the error, with every other code fixed
  (QuantEase's cyclic coordinate descent, on the format's grid). For row n and column j, a step
  d * s changes the error by -2 d s g[n, j] + s^2 H[j, j], with g = (W - Q) H;
- then refits each group's scale to its codes: Q's group columns are a * s with a = code - zero,
  so the best s moves by (a . g_G) / (a^T H_GG a), rounded to the dtype the checkpoint stores.

Both only lower the objective GPTQ minimises (a scale step that the storage rounding would make
worse is not taken). Zero points stay GPTQ's.

Rows are independent, and a code's step changes only its own row of g (by d s H[j, :]), so the
codes pass costs K per code moved plus a few N x K elementwise steps (the columns taken in
blocks, each block's decisions made for all rows at once and redone only on the rows where a code
moved), not the N x K per column of updating all of g; the scale pass costs at most one
N x K x K product (over the rows whose scales moved).
"""

from __future__ import annotations

import torch

from quantkit.format.packing import INT4_MAX, INT4_MIN

# Columns per block of the codes pass: the block's decisions are computed for all its columns at
# once, then redone only on the rows where a code moved, from that row's next column on.
_BLOCK = 128


def _codes_pass(
    codes: torch.Tensor, s: torch.Tensor, g: torch.Tensor, h: torch.Tensor, *, block: int = _BLOCK
) -> int:
    """One sweep over the columns; codes and g updated in place; returns the codes moved.

    The visits are the per-column sweep's, in the same order and on the same g: a move changes
    only its own row of g, so a row's decisions stay valid up to its next move. Per block of
    columns, every row's first moving column is found at once; each such move is taken and its
    row of g updated (g[n] -= d s h[j], as the sweep does), and the search resumes on those rows
    from the next column until none moves in the block. A step d = +-1 lowers the error where
    2 d s g > s^2 H[j, j] (at most one of the two can hold, and never where H[j, j] <= 0).
    """
    n, k = codes.shape
    diag = h.diagonal()
    inf = float("inf")
    moved = 0
    for b0 in range(0, k, block):
        b1 = min(k, b0 + block)
        s_b = s[:, b0:b1]
        two_s = 2.0 * s_b
        cost = (s_b * s_b * diag[b0:b1]).masked_fill_(diag[b0:b1] <= 0, inf)
        c = codes[:, b0:b1]
        up_above = torch.where(c < INT4_MAX, cost, inf)  # the step up where 2 s g exceeds it
        down_below = torch.where(c > INT4_MIN, -cost, -inf)  # down where 2 s g is below it
        pos = torch.arange(b1 - b0, device=h.device)
        rows = torch.arange(n, device=h.device)
        t = g[:, b0:b1] * two_s
        up, down = t > up_above, t < down_below
        hit = up | down
        while True:
            first = hit.byte().argmax(1)  # each row's first hit (0 where none)
            keep = hit.gather(1, first[:, None]).squeeze(1).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            j = first[keep]
            step = up[keep, j].to(h.dtype) - down[keep, j].to(h.dtype)
            rows = rows[keep]
            g.index_add_(0, rows, (step * s_b[rows, j])[:, None] * h[b0 + j], alpha=-1)
            codes[rows, b0 + j] += step
            moved += rows.numel()
            t = g[rows, b0:b1] * two_s[rows]
            up, down = t > up_above[rows], t < down_below[rows]
            hit = (up | down) & (pos > j[:, None])
    return moved


def _scales_pass(
    codes: torch.Tensor,
    z: torch.Tensor,
    scale: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype,
) -> None:
    """Each group's scale refit to its codes (scale [N, K/G] and g updated in place)."""
    k = codes.shape[1]
    for grp in range(scale.shape[1]):
        cols = slice(grp * group_size, min(k, (grp + 1) * group_size))
        a = codes[:, cols] - z[:, cols]  # Q[:, cols] = a * s
        h_gg = h[cols, cols]
        denom = ((a @ h_gg) * a).sum(1)
        along = (a * g[:, cols]).sum(1)  # a . g
        want = scale[:, grp] + torch.where(denom > 0, along / denom, 0.0)
        new = want.to(dtype).to(h.dtype)  # as the checkpoint stores it
        delta = new - scale[:, grp]
        # The error's change for a scale step delta: -2 delta (a . g) + delta^2 a^T H a.
        change = -2.0 * delta * along + delta * delta * denom
        rows = ((change < 0) & (new > 0)).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        scale[rows, grp] += delta[rows]
        # Only the rows whose scale moved change their g (all rows: one product in place).
        step = delta[rows, None] * a[rows]
        if rows.numel() == g.shape[0]:
            g.addmm_(step, h[cols, :], alpha=-1)
        else:
            g.index_add_(0, rows, step @ h[cols, :], alpha=-1)


def refine_int4(
    w: torch.Tensor,
    q: torch.Tensor,
    h: torch.Tensor,
    *,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    passes: int,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q [N, K] fp32, its scales [N, K/G] fp32 holding `scale_dtype` values): the INT4 Q on
    `scale` and `zero` (None: symmetric) refined by `passes` passes of codes then scales."""
    if passes < 0:
        raise ValueError(f"passes: expected >= 0, got {passes}")
    k = w.shape[1]

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.double().repeat_interleave(group_size, dim=1)[:, :k]

    h64 = h.double()
    scale = scale.double().clone()
    z = torch.zeros_like(per_column(scale)) if zero is None else per_column(zero)
    codes = torch.round(q.double() / per_column(scale) + z)
    g = (w.double() - (codes - z) * per_column(scale)) @ h64
    for _ in range(passes):
        moved = _codes_pass(codes, per_column(scale), g, h64)
        _scales_pass(codes, z, scale, g, h64, group_size=group_size, dtype=scale_dtype)
        if moved == 0:
            break
    q = ((codes - z) * per_column(scale)).float()
    return q, scale.float()

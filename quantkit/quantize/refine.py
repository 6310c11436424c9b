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
worse is not taken). Rows are independent; a pass costs about two N x K x K products. Zero
points stay GPTQ's.
"""

from __future__ import annotations

import torch

from quantkit.format.packing import INT4_MAX, INT4_MIN


def _codes_pass(codes: torch.Tensor, s: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> int:
    """One sweep over the columns; codes and g updated in place; returns the codes moved."""
    n, k = codes.shape
    diag = h.diagonal()
    moved = 0
    for j in range(k):
        if diag[j] <= 0:
            continue
        sj = s[:, j]
        best = torch.zeros(n, dtype=h.dtype, device=h.device)
        step = torch.zeros(n, dtype=h.dtype, device=h.device)
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
        delta = torch.where((change < 0) & (new > 0), delta, torch.zeros_like(delta))
        if bool(delta.any()):
            scale[:, grp] += delta
            g -= (delta[:, None] * a) @ h[cols, :]


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

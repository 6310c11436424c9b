"""Perplexity over held-out text with a sliding window, and a logit comparison vs a reference.

Windows of `window` tokens start every `stride` tokens; each window scores only the tokens no
earlier window scored, with everything before them in the window as context. stride == window
gives disjoint chunks (fast); a smaller stride gives every scored token more context.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids [B, T] -> logits [B, T, V]


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    window: int
    stride: int


def _windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index within the window) for each window."""
    out, scored_to = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        first = max(scored_to - begin, 1)  # position 0 has no context to predict it from
        if end - begin > first:
            out.append((begin, end, first))
        scored_to = end
        if end == n:
            break
    return out


def perplexity(
    logits_fn: LogitsFn,
    tokens: torch.Tensor,
    *,
    window: int = 512,
    stride: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> Perplexity:
    """Perplexity of 1-D `tokens` under `logits_fn`."""
    stride = stride or window
    if tokens.dim() != 1 or tokens.numel() < 2:
        raise ValueError(f"expected a 1-D tensor of at least 2 tokens, got {tuple(tokens.shape)}")
    if not 0 < stride <= window:
        raise ValueError(f"expected 0 < stride <= window ({window}), got {stride}")
    wins = _windows(tokens.numel(), window, stride)
    nll, count = 0.0, 0
    # Windows of equal length batch together; only the last may be shorter.
    batches: list[list[tuple[int, int, int]]] = []
    for w in wins:
        if (
            batches
            and len(batches[-1]) < batch_size
            and (batches[-1][0][1] - batches[-1][0][0] == w[1] - w[0])
        ):
            batches[-1].append(w)
        else:
            batches.append([w])
    bar = tqdm(total=len(wins), desc="perplexity", unit="win", disable=not progress, leave=False)
    with torch.no_grad():
        for batch in batches:
            ids = torch.stack([tokens[b:e] for b, e, _ in batch])
            logits = logits_fn(ids).float()
            # One row's log-probabilities at a time, of its scored positions only: beside the
            # batch's logits, a window's worth lives at once (log_softmax is per position, so
            # the values are those of the whole batch's).
            for row, (_, _, first) in enumerate(batch):
                target = ids[row, first:].to(logits.device)
                logp = F.log_softmax(logits[row, first - 1 : -1], dim=-1)
                nll -= float(logp.gather(-1, target.unsqueeze(-1)).sum())
                count += target.numel()
                del logp
            del logits  # before the next batch's forward
            bar.update(len(batch))
    bar.close()
    mean = nll / count
    return Perplexity(math.exp(mean), mean, count, window, stride)


@dataclass(frozen=True)
class LogitAgreement:
    kl: float  # mean KL(reference || candidate) per token, nats
    top1: float  # share of positions where the argmax agrees
    tokens: int


def compare_logits(
    reference: LogitsFn,
    candidate: LogitsFn,
    tokens: torch.Tensor,
    *,
    window: int = 512,
    batch_size: int = 4,
) -> LogitAgreement:
    """Mean KL divergence and top-1 agreement of next-token distributions on `tokens`."""
    n = (tokens.numel() // window) * window
    if n == 0:
        raise ValueError(f"expected at least {window} tokens, got {tokens.numel()}")
    chunks = tokens[:n].view(-1, window)
    kl, agree, count = 0.0, 0, 0
    with torch.no_grad():
        for ids in chunks.split(batch_size):
            p = F.log_softmax(reference(ids).float(), dim=-1)
            q = F.log_softmax(candidate(ids).float(), dim=-1)
            kl += float((p.exp() * (p - q)).sum())
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            count += ids.numel()
    return LogitAgreement(kl / count, agree / count, count)

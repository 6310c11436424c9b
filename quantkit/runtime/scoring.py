"""Log-probabilities of tokens: the one definition every caller shares.

A token's log-probability is the float32 log-softmax of the model's logits at the position
before it: the model's own distribution, before any logits processor (penalties, a grammar
mask), temperature or filter. `quantkit lm-eval` scores continuations with it
(`quantkit.evals.accuracy.continuations`), and `quantkit serve` returns it as OpenAI's
`logprobs`, for generated tokens and, with `echo`, for the prompt's (`prompt_logprobs`), so the
two give the same numbers on the same checkpoint.

`prompt_logprobs` runs the PyTorch forward with a KV cache of its own, as the lm-eval scorer
does (`setup_cache`, explicit positions and causal mask), not the serving engine's decode step;
whoever calls it must own the model for the duration (the server runs it on its engine thread,
with the engine's slot caches set aside).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantkit.errors import GenerationError
from quantkit.models.decoder import CausalLM

__all__ = ["TokenLogprob", "causal_mask", "log_probs", "prompt_logprobs", "token_logprob"]

# Prompt positions per forward in `prompt_logprobs`: bounds the logits held at once
# ([chunk, vocab] float32, 50 MB at SmolLM2's 49k vocabulary).
PROMPT_CHUNK = 256


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely tokens at its position,
    (token id, log-probability) most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the last (vocabulary) dimension."""
    return F.log_softmax(logits.float(), dim=-1)


def causal_mask(positions: torch.Tensor, slots: int) -> torch.Tensor:
    """Attention mask [B, 1, T, slots]: the query at position p sees cache slots 0..p."""
    return (torch.arange(slots, device=positions.device) <= positions[:, :, None]).unsqueeze(1)


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s entry in one position's log-probabilities [V], with the `top` best."""
    entry = float(logprobs[token])
    if top <= 0:
        return TokenLogprob(token, entry)
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
    best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, entry, best)


@torch.inference_mode()
def prompt_logprobs(
    model: CausalLM, ids: Sequence[int], *, top: int = 0, chunk: int = PROMPT_CHUNK
) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it; None for the first,
    which has no context (as OpenAI and vLLM return it). The prompt runs through the model in
    chunks of `chunk` positions into a cache of its own, which is dropped afterwards."""
    tokens = [int(t) for t in ids]
    if not tokens:
        raise GenerationError("prompt_logprobs: expected at least one token, got none")
    device = model.device
    out: list[TokenLogprob | None] = [None]
    model.setup_cache(batch=1, max_len=len(tokens))
    try:
        for start in range(0, len(tokens) - 1, chunk):
            end = min(start + chunk, len(tokens) - 1)  # the last token predicts nothing asked
            positions = torch.arange(start, end, device=device)[None]
            feed = torch.tensor([tokens[start:end]], device=device)
            logits = model(feed, positions=positions, mask=causal_mask(positions, len(tokens)))
            logprobs = log_probs(logits[0])
            for row, target in enumerate(tokens[start + 1 : end + 1]):
                out.append(token_logprob(logprobs[row], target, top))
    finally:
        model.drop_cache()
    return out

"""What the quantization studies share: the held-out split of a model and its reference
perplexity (the dense model, windows of 512), the baseline every variant is compared with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.evals.accuracy.perplexity import perplexity
from quantkit.quantize.calibration import heldout_tokens
from quantkit.quantize.pipeline import load_dense
from quantkit.sources.resolve import resolve_model
from quantkit.sources.tokenizer import load_tokenizer

WINDOW = 512  # every study's perplexity window


@dataclass(frozen=True)
class HeldOut:
    model_dir: Path
    tokenizer: Any
    tokens: torch.Tensor  # the held-out split, at most the tokens asked for


def held_out(model: str, eval_tokens: int) -> HeldOut:
    """`model` resolved, its tokenizer, and its held-out tokens."""
    model_dir = resolve_model(model)
    tok = load_tokenizer(model_dir)
    return HeldOut(model_dir, tok, heldout_tokens(tok, max_tokens=eval_tokens))


def ppl(model: Any, tokens: torch.Tensor) -> float:
    return perplexity(model, tokens, window=WINDOW, progress=True).ppl


def earlier_baseline(path: Path | None, want: dict[str, Any]) -> dict[str, Any] | None:
    """An earlier run's JSON (its reference and RTN perplexities), when it was measured on what
    `want` says (the same model, tokens, window and group); None without a path."""
    if path is None:
        return None
    old = json.loads(path.read_text())
    if any(old.get(k) != v for k, v in want.items()):
        raise SystemExit(f"--baseline {path}: measured on {[old.get(k) for k in want]}")
    return old


def reference_ppl(held: HeldOut) -> float:
    """The dense model's perplexity on the held-out tokens (the model freed after)."""
    _, dense, _ = load_dense(held.model_dir)
    return ppl(dense, held.tokens)

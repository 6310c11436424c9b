"""`QuantkitLM`: lm-eval's model interface on quantkit's own runtime (dense, INT4, FP8).

Registered with lm-eval as "quantkit" when `quantkit.evals` is imported, so
`lm_eval.simple_evaluate(model="quantkit", model_args={"pretrained": CKPT}, ...)` works, and
`quantkit lm-eval --model_args pretrained=CKPT ...` runs lm-eval's own CLI with it.

Tokenization follows lm-eval's Hugging Face backend (`HFLM`) so that numbers are comparable: a
(context, continuation) pair is encoded whole and split at the context's length, an empty
context becomes the prefix token (BOS, else EOS), and rolling log-likelihoods start from that
prefix token. `add_bos_token`: None = the tokenizer's own default, True = every sequence starts
with BOS (prepended if the tokenizer does not add it), False = never add special tokens.

Log-likelihoods are batched, longest first, and requests with the same context (the choices of
a multiple-choice item) run that context once: see `quantkit.evals.accuracy.continuations`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from quantkit.errors import EvalError, MissingExtraError
from quantkit.evals.accuracy.continuations import plan_batches, score_continuations
from quantkit.evals.accuracy.perplexity import perplexity
from quantkit.format.dtypes import DTYPES
from quantkit.models.decoder import CausalLM
from quantkit.runtime.generate import eos_token_ids, generate
from quantkit.runtime.loader import LoadedModel, load_model
from quantkit.runtime.sampling import SamplingParams

try:  # the adapter subclasses lm-eval's base class, so this module needs lm-eval at import
    from lm_eval.api.model import TemplateLM
except ImportError as e:
    raise MissingExtraError("lm-eval", "eval") from e

__all__ = ["QuantkitLM"]

# Rolling windows and the default context: logits are [T, vocab] fp32 (and log_softmax doubles
# them), 0.4 GB per 2048 tokens at SmolLM2's 49k vocab; the full 8k context would need 3 GB.
_DEFAULT_MAX_LENGTH = 2048

# (context tokens, continuation tokens) after truncation to the context window.
Pair = tuple[tuple[int, ...], tuple[int, ...]]


def _as_bool(name: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise EvalError(f"{name}: expected true or false, got {value!r}")


def _as_int(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise EvalError(f"{name}: expected an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise EvalError(f"{name}: expected an integer >= {minimum}, got {number}")
    return number


def _device(name: str | None) -> torch.device:
    """lm-eval's CLI passes device=cuda by default; like its HF backend, fall back to the CPU
    when there is no CUDA device rather than fail."""
    if name is None or (str(name).startswith("cuda") and not torch.cuda.is_available()):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise EvalError(f"device: expected cpu, cuda or cuda:N, got {name!r}") from None


class QuantkitLM(TemplateLM):
    """lm-eval `LM` over a quantkit model. Options (lm-eval `model_args`):

    pretrained: a checkpoint or model directory, a .gguf file, "smollm2-135m", or a LoadedModel.
    batch_size: the most contexts per forward ("auto" = 32); max_batch_tokens: the most tokens
        per forward (padding included), which is what bounds memory on CPU.
    dtype: float32 (default; this CPU has no bf16 instructions), bfloat16 or float16.
    add_bos_token: see the module docstring; prefix_token_id: overrides the prefix token.
    max_length: the context window (default: the model's, capped at 2048); rolling_stride:
        tokens between rolling windows (default max_length - 1: each token scored once).
    max_gen_toks: generate_until's default token limit; progress: show progress bars.
    """

    backend = "causal"

    def __init__(
        self,
        *,
        pretrained: str | Path | LoadedModel,
        batch_size: int | str | None = None,
        max_batch_size: int | str | None = None,
        max_batch_tokens: int | str = 2048,
        device: str | None = None,
        dtype: str = "float32",
        add_bos_token: bool | str | None = None,
        prefix_token_id: int | str | None = None,
        max_length: int | str | None = None,
        rolling_stride: int | str | None = None,
        max_gen_toks: int | str = 256,
        progress: bool | str = True,
    ) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise EvalError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        if isinstance(pretrained, LoadedModel):
            loaded = pretrained
        else:
            loaded = load_model(pretrained, dtype=DTYPES[dtype], device=_device(device))
        if loaded.tokenizer is None:
            raise EvalError(f"{loaded.path}: expected a model with a tokenizer, got none")
        self.loaded = loaded
        self.model: CausalLM = loaded.model
        self.tokenizer = loaded.tokenizer
        self._device = self.model.device
        auto = batch_size is None or str(batch_size).startswith("auto")
        self.batch_size = 32 if auto else _as_int("batch_size", batch_size, 1)
        if max_batch_size is not None:
            self.batch_size = min(self.batch_size, _as_int("max_batch_size", max_batch_size, 1))
        self.max_batch_tokens = _as_int("max_batch_tokens", max_batch_tokens, 16)
        self.add_bos_token = _as_bool("add_bos_token", add_bos_token)
        self._prefix_token_id = _as_int("prefix_token_id", prefix_token_id, 0)
        context = self.model.config.max_position_embeddings
        self._max_length = _as_int("max_length", max_length, 2) or min(context, _DEFAULT_MAX_LENGTH)
        if self._max_length > context:
            raise EvalError(
                f"max_length: expected at most the model's context window {context}, "
                f"got {self._max_length}"
            )
        self.rolling_stride = _as_int("rolling_stride", rolling_stride, 1)
        if self.rolling_stride is not None and self.rolling_stride >= self._max_length:
            raise EvalError(
                f"rolling_stride: expected < max_length ({self._max_length}), "
                f"got {self.rolling_stride}"
            )
        self.max_gen_toks = _as_int("max_gen_toks", max_gen_toks, 1)
        self.progress = bool(_as_bool("progress", progress))
        self._eos_ids = eos_token_ids(
            tokenizer=self.tokenizer, config=loaded.config, model_dir=loaded.path
        )

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else min(self._eos_ids, default=0)

    @property
    def prefix_token_id(self) -> int:
        if self._prefix_token_id is not None:
            return self._prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", self.loaded.path)).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        bos = self.tokenizer.bos_token_id
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token is not False
            # A prompt that already starts with BOS (a chat template's output) gets no second.
            bos_text = self.tokenizer.bos_token
            if bos_text and string.startswith(bos_text):
                return list(self.tokenizer.encode(string, add_special_tokens=False))
        ids = list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))
        if add_special_tokens and self.add_bos_token and bos is not None:
            if not ids or ids[0] != bos:
                ids.insert(0, bos)
        return ids

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    # ------------------------------------------------------------------ loglikelihood

    def _fit(self, context: list[int], continuation: list[int]) -> Pair:
        """Left-truncate so that context + continuation[:-1] fits the window, as HFLM does."""
        if not continuation:
            raise EvalError("loglikelihood: expected a non-empty continuation, got none")
        if len(continuation) > self._max_length:
            raise EvalError(
                f"loglikelihood: expected a continuation of at most {self._max_length} tokens "
                f"(max_length), got {len(continuation)}"
            )
        keep = self._max_length + 1 - len(continuation)
        return tuple(context[-keep:]), tuple(continuation)

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        pairs = [self._fit(ctx, cont) for _, ctx, cont in requests]
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (ctx, _) in enumerate(pairs):
            groups[ctx].append(i)
        # Longest first, so similar lengths share a batch (less padding).
        order = sorted(groups, key=lambda c: -(len(c) + max(len(pairs[i][1]) for i in groups[c])))
        plan = plan_batches(
            [(len(ctx), [len(pairs[i][1]) for i in groups[ctx]]) for ctx in order],
            batch_size=self.batch_size,
            max_tokens=self.max_batch_tokens,
        )
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        bar = tqdm(
            total=len(pairs),
            desc="loglikelihood",
            unit="req",
            disable=disable_tqdm or not self.progress,
        )
        for indices in plan:
            batch = [order[j] for j in indices]
            conts = [[pairs[i][1] for i in groups[ctx]] for ctx in batch]
            scored = score_continuations(self.model, batch, conts)
            for ctx, per_ctx in zip(batch, scored, strict=True):
                for i, result in zip(groups[ctx], per_ctx, strict=True):
                    results[i] = result
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
            bar.update(sum(len(groups[ctx]) for ctx in batch))
        bar.close()
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ rolling

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(ids.to(self._device))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """log p(text) from the prefix token on, in windows of max_length tokens starting every
        rolling_stride tokens (each token scored once, with the window before it as context):
        `quantkit.evals.accuracy.perplexity.perplexity` over [prefix] + tokens."""
        window = self._max_length
        stride = self.rolling_stride or window - 1
        out = []
        for req in tqdm(
            requests, desc="rolling", unit="doc", disable=disable_tqdm or not self.progress
        ):
            (text,) = req.args
            tokens = [self.prefix_token_id, *self.tok_encode(text, add_special_tokens=False)]
            if len(tokens) < 2:
                out.append(0.0)
                continue
            res = perplexity(
                self._logits,
                torch.tensor(tokens),
                window=window,
                stride=stride,
                batch_size=max(1, self.max_batch_tokens // window),
            )
            ll = -res.nll * res.tokens
            out.append(ll)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
        return out

    # ------------------------------------------------------------------ generation

    def _sampling(self, gen_kwargs: dict[str, Any]) -> SamplingParams:
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        limit = _as_int("max_gen_toks", gen_kwargs.get("max_gen_toks", self.max_gen_toks), 1)
        sample = bool(_as_bool("do_sample", gen_kwargs.get("do_sample", False)))
        temperature = float(gen_kwargs.get("temperature", 1.0 if sample else 0.0))
        return SamplingParams(
            temperature=temperature if sample else 0.0,
            top_p=float(gen_kwargs.get("top_p", 1.0)) if sample else 1.0,
            top_k=_as_int("top_k", gen_kwargs.get("top_k"), 0) if sample else None,
            seed=_as_int("seed", gen_kwargs.get("seed", 1234), 0),
            max_new_tokens=limit,
            stop=tuple(s for s in until if s),
        )

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context until a stop string (`until`), EOS or max_gen_toks;
        greedy unless gen_kwargs says do_sample. Batched by identical gen_kwargs."""
        by_kwargs: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_kwargs[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        out: list[str] = [""] * len(requests)
        bar = tqdm(
            total=len(requests),
            desc="generate",
            unit="req",
            disable=disable_tqdm or not self.progress,
        )
        for indices in by_kwargs.values():
            params = self._sampling(requests[indices[0]].args[1])
            room = self._max_length - params.max_new_tokens
            if room < 1:
                raise EvalError(
                    f"max_gen_toks: expected fewer than max_length ({self._max_length}) tokens, "
                    f"got {params.max_new_tokens}"
                )
            prompts = {i: self.tok_encode(requests[i].args[0])[-room:] for i in indices}
            ordered = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(ordered), self.batch_size):
                chunk = ordered[start : start + self.batch_size]
                result = generate(
                    self.model,
                    [prompts[i] or [self.prefix_token_id] for i in chunk],
                    params,
                    eos_ids=self._eos_ids,
                    tokenizer=self.tokenizer,
                )
                for i, text in zip(chunk, result.texts or [], strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return out

    def __repr__(self) -> str:
        scheme = self.loaded.describe()
        return f"QuantkitLM({self.loaded.path}, {scheme}, max_length={self._max_length})"

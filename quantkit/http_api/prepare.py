"""A validated request body -> what the engine runs: prompt token ids, the token limit,
`SamplingParams` and the logits processors (a grammar for `response_format`).

Everything here raises `ServerError` (a 4xx with the offending `param`) before anything is
submitted, so a bad request never reaches the engine and never costs a token. A JSON schema is
lowered and compiled here too (in a worker thread, see `GrammarCache`), so a schema the grammar
layer cannot handle is a 400 naming the keyword before any token is generated.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from quantkit.errors import GenerationError, GrammarError
from quantkit.grammar.compiler import DEFAULT_TIMEOUT_S, compile_grammar
from quantkit.grammar.constraints import json_schema_grammar
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.vocabulary import TokenVocabulary
from quantkit.http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    ServerError,
)
from quantkit.runtime.generate import encode_prompt
from quantkit.runtime.sampling import LogitsProcessor, RepetitionPenalty, SamplingParams

__all__ = ["GrammarCache", "Prepared", "chat_prompt", "check_unsupported", "completion_prompt"]

# The default `max_tokens` of /v1/completions, as OpenAI's; chat defaults to the context left.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass
class Prepared:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    processors: list[LogitsProcessor]


def check_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for what quantkit cannot do, rather than silently ignoring it."""
    if body.n != 1:
        raise ServerError(f"n: only n=1 is supported, got {body.n}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            raise ServerError(
                f"{name}: not supported (use repetition_penalty), got {value}", param=name
            )
    if body.logprobs not in (None, False, 0):
        raise ServerError("logprobs: not supported", param="logprobs")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise ServerError("echo: not supported", param="echo")
        if body.suffix:
            raise ServerError("suffix: not supported", param="suffix")
        if body.best_of not in (None, 1):
            raise ServerError(f"best_of: only 1 is supported, got {body.best_of}", param="best_of")
    elif body.tools:
        raise ServerError("tools: not supported", param="tools")


def completion_prompt(body: CompletionRequest, tokenizer: Any, vocab: int) -> list[int]:
    """A string (tokenized with the tokenizer's special tokens) or token ids; one prompt."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ServerError(
                f"prompt: one prompt per request is supported, got {len(prompt)}", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            return encode_prompt(tokenizer, prompt, chat=False)
        except GenerationError as e:
            raise ServerError(str(e), param="prompt") from None
    ids = list(prompt)
    if not ids:
        raise ServerError("prompt: expected at least one token, got none", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ServerError(
            f"prompt: expected token ids in [0, {vocab}), got {bad[0]}", param="prompt"
        )
    return ids


def chat_prompt(body: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    """The messages through the tokenizer's chat template, with the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ServerError(
            "messages: this model's tokenizer has no chat template; use /v1/completions",
            param="messages",
        )
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja, its own checks)
        raise ServerError(
            f"messages: the chat template refused them: {e}", param="messages"
        ) from None
    # The template holds the special tokens; adding them again would double BOS.
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def max_tokens_for(
    body: CompletionRequest | ChatCompletionRequest, prompt_len: int, context: int
) -> int:
    """The token limit: given (>= 1) or the endpoint's default; prompt + limit <= context."""
    param, given = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        param, given = "max_completion_tokens", body.max_completion_tokens
    if given is not None and given < 1:
        raise ServerError(f"{param}: expected an integer >= 1, got {given}", param=param)
    if prompt_len >= context:
        raise ServerError(
            f"This model's maximum context length is {context} tokens. However, your prompt "
            f"is {prompt_len} tokens, which leaves no room to generate.",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if given is None:
        default = COMPLETION_DEFAULT_MAX_TOKENS if isinstance(body, CompletionRequest) else None
        return min(default or context, context - prompt_len)
    if prompt_len + given > context:
        raise ServerError(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + given} tokens ({prompt_len} in the prompt, {given} in the "
            f"completion). Please reduce the prompt or the completion length.",
            param=param,
            code="context_length_exceeded",
        )
    return given


def sampling_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop):
        raise ServerError("stop: expected non-empty strings", param="stop")
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            seed=body.seed,
            stop=stop,
        )
    except GenerationError as e:
        raise ServerError(str(e), param=str(e).split(":")[0]) from None


class GrammarCache:
    """The token vocabulary (built once, on first use) and compiled grammars per schema (the
    grammar layer caches indexes in memory and on disk; this adds nothing but the vocabulary)."""

    def __init__(self, loaded: Any, eos_ids: set[int], *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.loaded, self.eos_ids, self.timeout_s = loaded, eos_ids, timeout_s
        self._vocab: TokenVocabulary | None = None
        self._lock = threading.Lock()

    def vocabulary(self) -> TokenVocabulary:
        with self._lock:
            if self._vocab is None:
                self._vocab = TokenVocabulary.from_tokenizer(
                    self.loaded.tokenizer,
                    eos_token_ids=self.eos_ids,
                    vocab_size=self.loaded.config.get("vocab_size"),
                )
            return self._vocab

    def processor(self, fmt: ResponseFormat, *, max_tokens: int) -> GrammarLogitsProcessor | None:
        """The processor `response_format` asks for (None for text). Blocking: call it from a
        worker thread."""
        if fmt.type == "text":
            return None
        if fmt.type == "json_object":
            schema: Any = {"type": "object"}
            label = "json_object"
        else:
            if fmt.json_schema is None:
                raise ServerError(
                    "response_format: type json_schema needs a json_schema object "
                    '({"name", "schema", "strict"})',
                    param="response_format",
                )
            schema, label = fmt.json_schema.schema_, f"schema {fmt.json_schema.name}"
        try:
            grammar = json_schema_grammar(schema, label=label)
            compiled = compile_grammar(grammar, self.vocabulary(), timeout_s=self.timeout_s)
        except GrammarError as e:
            raise ServerError(f"response_format: {e}", param="response_format") from None
        return GrammarLogitsProcessor(compiled, max_new_tokens=max_tokens)


def prepare(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    tokenizer: Any,
    vocab: int,
    context: int,
) -> Prepared:
    """Everything but the grammar (which compiles off the event loop)."""
    check_unsupported(body)
    if isinstance(body, ChatCompletionRequest):
        prompt = chat_prompt(body, tokenizer)
    else:
        prompt = completion_prompt(body, tokenizer, vocab)
    max_tokens = max_tokens_for(body, len(prompt), context)
    params = sampling_params(body)
    processors: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(params.repetition_penalty))
    return Prepared(prompt, max_tokens, params, processors)

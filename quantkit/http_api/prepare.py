"""A validated request body -> what the engine runs: prompt token ids (several prompts on
/v1/completions), the token limit, `SamplingParams`, the penalties as logits processors (a
grammar for `response_format` is added by the app), `n`, `logprobs` and `echo`.

Everything here raises `ServerError` (a 4xx with the offending `param`) before anything is
submitted, so a bad request never reaches the engine and never costs a token. A JSON schema is
lowered and compiled here too (in a worker thread, see `GrammarCache`), so a schema the grammar
layer cannot handle is a 400 naming the keyword before any token is generated.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quantkit.errors import GenerationError, GrammarError
from quantkit.grammar.compiler import DEFAULT_TIMEOUT_S, compile_grammar
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.reasoning import ReasoningFormat, reasoning_for
from quantkit.grammar.vocabulary import TokenVocabulary
from quantkit.http_api.constraints import request_grammar
from quantkit.http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ServerError,
)
from quantkit.http_api.tools import ToolPlan, tool_plan, tool_prompt
from quantkit.runtime.generate import encode_prompt
from quantkit.runtime.sampling import (
    LogitsProcessor,
    PresenceFrequencyPenalty,
    RepetitionPenalty,
    SamplingParams,
)

__all__ = [
    "GrammarCache",
    "Prepared",
    "chat_prompt",
    "check_unsupported",
    "choice_seed",
    "completion_prompts",
]

# The default `max_tokens` of /v1/completions, as OpenAI's; chat defaults to the context left.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# The most alternatives per token `logprobs` / `top_logprobs` may ask for (OpenAI's chat limit;
# its completions endpoint stops at 5, vLLM's at 20).
MAX_TOP_LOGPROBS = 20


@dataclass
class Prepared:
    """prompts: one per prompt (/v1/completions may send several), each answered by `n`
    choices; texts: each prompt as text (what `echo` prepends); max_tokens: per prompt (0: echo
    only, nothing generated); logprobs: None = off, else how many alternatives per token."""

    prompts: list[list[int]]
    texts: list[str]
    max_tokens: list[int]
    params: SamplingParams
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: ToolPlan | None = None  # chat with tools (`tools.tool_plan`)
    # A reasoning model's chat (`quantkit.grammar.reasoning`): its markers, whether the prompt
    # opened the thinking, the thinking's token cap.
    reasoning: ReasoningFormat | None = None
    prompt_open: bool = False
    reasoning_budget: int | None = None

    def processors(self, prompt: Sequence[int]) -> list[LogitsProcessor]:
        """The penalties of one choice of `prompt` (a grammar, when asked, is added by the app:
        each choice needs its own, as each holds its own state)."""
        out: list[LogitsProcessor] = []
        if self.params.repetition_penalty != 1.0:
            out.append(RepetitionPenalty(self.params.repetition_penalty))
        if self.presence_penalty or self.frequency_penalty:
            out.append(
                PresenceFrequencyPenalty(self.presence_penalty, self.frequency_penalty, prompt)
            )
        return out

    def seed(self, choice: int) -> int | None:
        return choice_seed(self.params.seed, choice)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a request seeded with `seed`: the seed itself for choice 0
    (so n=1 and choice 0 of n>1 agree), a fixed derivation for the others, so that every choice
    is an independent, reproducible sample. None stays None (fresh randomness per choice)."""
    if seed is None or choice == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + choice * 0xBF58476D1CE4E5B9) % (1 << 63)


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not (low <= value <= high):
        raise ServerError(f"{name}: expected a number in [{low}, {high}], got {value}", param=name)


def logprobs_wanted(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives per token the request asks for; None = no logprobs (checked)."""
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise ServerError(
                f"logprobs: expected true or false, got {body.logprobs}", param="logprobs"
            )
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ServerError(
                f"top_logprobs: expected an integer in [0, {MAX_TOP_LOGPROBS}], got {top}",
                param="top_logprobs",
            )
        if top is not None and not body.logprobs:
            raise ServerError(
                "top_logprobs: expected logprobs: true with it, got logprobs "
                f"{json_value(body.logprobs)}",
                param="top_logprobs",
            )
        return (top or 0) if body.logprobs else None
    value = body.logprobs
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ServerError(
            f"logprobs: expected an integer in [0, {MAX_TOP_LOGPROBS}], got {json_value(value)}",
            param="logprobs",
        )
    return value


def json_value(value: object) -> str:
    """A value as the JSON body spelled it (true, null), for messages."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(value)


def check_unsupported(body: CompletionRequest | ChatCompletionRequest, *, slots: int) -> None:
    """400 for what quantkit cannot do or what is out of range, rather than silently ignoring
    it. n is at most `slots` (the engine's batch cap: the choices of a request run side by
    side); best_of only as n (no ranking); suffix not at all."""
    if body.n > slots:
        raise ServerError(
            f"n: expected at most {slots} (this server's batch cap), got {body.n}", param="n"
        )
    _check_range("presence_penalty", body.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", body.frequency_penalty, -2.0, 2.0)
    logprobs_wanted(body)
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise ServerError("suffix: not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise ServerError(
                f"best_of: only best_of = n ({body.n}) is supported, got {body.best_of}",
                param="best_of",
            )


def completion_prompts(body: CompletionRequest, tokenizer: Any, vocab: int) -> list[list[int]]:
    """Each prompt: a string (tokenized with the tokenizer's special tokens) or token ids; a
    list of strings or of token-id lists is several prompts."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return [_one_prompt(p, tokenizer, vocab) for p in prompt]
    return [_one_prompt(prompt, tokenizer, vocab)]


def _one_prompt(prompt: Any, tokenizer: Any, vocab: int) -> list[int]:
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


def chat_prompt(
    body: ChatCompletionRequest, tokenizer: Any, plan: ToolPlan | None = None
) -> list[int]:
    """The messages through the tokenizer's chat template, with the assistant turn opened
    (and the tools shown, assistant calls and tool results rendered: `tools.tool_prompt`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ServerError(
            "messages: this model's tokenizer has no chat template; use /v1/completions",
            param="messages",
        )
    try:
        rendered = tool_prompt(body, tokenizer, plan)
    except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja, its own checks)
        raise ServerError(
            f"messages: the chat template refused them: {e}", param="messages"
        ) from None
    # The template holds the special tokens; adding them again would double BOS.
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def max_tokens_for(
    body: CompletionRequest | ChatCompletionRequest, prompt_len: int, context: int
) -> int:
    """The token limit: given (>= 1; 0 with echo: score the prompt only) or the endpoint's
    default; prompt + limit <= context. max_completion_tokens wins over max_tokens."""
    param, given = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        param, given = "max_completion_tokens", body.max_completion_tokens
    echo_only = isinstance(body, CompletionRequest) and body.echo and given == 0
    if given is not None and given < 1 and not echo_only:
        least = "0 with echo, else >= 1" if isinstance(body, CompletionRequest) else ">= 1"
        raise ServerError(f"{param}: expected an integer >= {least}, got {given}", param=param)
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

    def tool_processor(
        self, plan: ToolPlan, *, max_tokens: int, greedy: bool = False
    ) -> GrammarLogitsProcessor | None:
        """The processor of the tool calls `plan` allows (None for tool choice none); a 400
        naming `tools` if the grammar cannot be built. greedy: the request samples by arg-max
        (the processor then skips the mask where the best token is allowed). Blocking: call it
        from a worker thread."""
        grammar = plan.grammar()
        if grammar is None:
            return None
        try:
            compiled = compile_grammar(grammar, self.vocabulary(), timeout_s=self.timeout_s)
        except GrammarError as e:
            raise ServerError(f"tools: {e}", param="tools") from None
        return GrammarLogitsProcessor(compiled, max_new_tokens=max_tokens, greedy=greedy)

    def processor(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        *,
        max_tokens: int,
        greedy: bool = False,
    ) -> GrammarLogitsProcessor | None:
        """The processor `response_format` or `structured_outputs` asks for (None: free text);
        a 400 naming the field for what cannot be built; greedy as in `tool_processor`.
        Blocking: call it from a worker thread."""
        asked = request_grammar(body, timeout_s=self.timeout_s)
        if asked is None:
            return None
        grammar, param = asked
        try:
            compiled = compile_grammar(grammar, self.vocabulary(), timeout_s=self.timeout_s)
        except GrammarError as e:
            raise ServerError(f"{param}: {e}", param=param) from None
        return GrammarLogitsProcessor(compiled, max_new_tokens=max_tokens, greedy=greedy)


def prepare(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    tokenizer: Any,
    vocab: int,
    context: int,
    slots: int,
) -> Prepared:
    """Everything but the grammar (which compiles off the event loop)."""
    check_unsupported(body, slots=slots)
    tools = None
    reasoning, prompt_open = None, False
    if isinstance(body, ChatCompletionRequest):
        tools = tool_plan(body, tokenizer)
        constrained = body.structured_outputs is not None or (
            body.response_format is not None and body.response_format.type != "text"
        )
        if tools is not None and tools.mode != "none" and constrained:
            field = "structured_outputs" if body.structured_outputs else "response_format"
            raise ServerError(
                f"{field}: expected none with tools (the calls are the constraint); use "
                f"tool_choice none or drop {field}",
                param=field,
            )
        prompts = [chat_prompt(body, tokenizer, tools)]
        texts = [""]
        echo = False
        reasoning = reasoning_for(getattr(tokenizer, "chat_template", None))
        if body.reasoning_budget is not None and reasoning is None:
            raise ServerError(
                "reasoning_budget: expected a reasoning model (its chat template speaks of "
                "<think>), got one that does not reason",
                param="reasoning_budget",
            )
        prompt_open = reasoning is not None and tokenizer.decode(
            prompts[0][-8:]).rstrip().endswith(reasoning.open)  # fmt: skip
    else:
        prompts = completion_prompts(body, tokenizer, vocab)
        raw = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        if raw and not isinstance(raw[0], (str, list)):  # one prompt of token ids
            raw = [raw]
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in raw]
        echo = body.echo
    return Prepared(
        prompts,
        texts,
        [max_tokens_for(body, len(p), context) for p in prompts],
        sampling_params(body),
        n=body.n,
        logprobs=logprobs_wanted(body),
        echo=echo,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        tools=tools,
        reasoning=reasoning,
        prompt_open=prompt_open,
        reasoning_budget=getattr(body, "reasoning_budget", None),
    )

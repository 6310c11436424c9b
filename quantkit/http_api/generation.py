"""/v1/completions and /v1/chat/completions: submit to the engine loop, answer in OpenAI's
shape, as one JSON body or as server-sent events (one `data: {...}` chunk per generated token,
each choice's last with its finish reason, then `data: [DONE]`).

A request is one or more choices: `n` per prompt (several prompts on /v1/completions), indexed
prompt by prompt (prompt i's choice j is index i * n + j, as OpenAI numbers them), each its own
engine request with its own seed, all sharing one queue of events. A choice with `max_tokens`
0 (echo only) generates nothing and is complete at once. With `echo`, the prompt's text (and,
with logprobs, its tokens' logprobs) comes first: in the JSON body, or as each choice's first
chunk.

A watcher task listens for the client's disconnect while a request runs; when it comes, every
choice is cancelled, so their KV slots are freed at the engine's next step even if they were
still waiting and had produced nothing to write.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from quantkit.grammar.reasoning import split_reasoning
from quantkit.http_api.engine_loop import EngineLoop, LiveRequest, TokenEvent
from quantkit.http_api.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from quantkit.http_api.prepare import Prepared
from quantkit.http_api.protocol import ChatCompletionRequest, CompletionRequest, ServerError
from quantkit.http_api.reasoning import ReasoningStream
from quantkit.http_api.tools import ToolStream, tool_message
from quantkit.runtime.scoring import TokenLogprob

__all__ = ["Choice", "Generation", "respond"]

_DISCONNECTED = TokenEvent("", "cancelled", 0)


@dataclass
class Choice:
    """One choice: its engine request (None when nothing is generated) and what it has so far.
    prompt_ids and prompt_logprobs: what echo returns before the generated tokens."""

    index: int
    live: LiveRequest | None
    echo_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    parts: list[str] = field(default_factory=list)
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    offset: int = 0  # the next token's text offset (completions' logprobs)
    tool_stream: ToolStream | None = None  # a streamed chat choice that may call tools
    reasoning_stream: ReasoningStream | None = None  # a streamed reasoning model's choice


class _ChoiceSink:
    """What a choice's engine request puts its events into: the request's one queue, tagged."""

    def __init__(self, queue: asyncio.Queue, index: int) -> None:
        self.queue, self.index = queue, index

    def put_nowait(self, event: TokenEvent) -> None:
        self.queue.put_nowait((self.index, event))


@dataclass
class Generation:
    """One request in flight: what was asked and its choices."""

    body: CompletionRequest | ChatCompletionRequest
    prepared: Prepared
    choices: list[Choice]
    model_name: str
    texts: TokenTexts

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prepared.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def _logprobs(
        self, choice: Choice, tokens: list[TokenLogprob], *, prompt: bool = False
    ) -> dict[str, Any] | None:
        """The `logprobs` of `tokens` (after the prompt's, with `prompt`), or None when off."""
        if self.prepared.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(tokens, self.texts)
        ids = [t.token for t in tokens]
        entries: list[TokenLogprob | None] = list(tokens)
        if prompt and choice.prompt_logprobs is not None:
            ids = [*choice.prompt_ids, *ids]
            entries = [*choice.prompt_logprobs, *entries]
        out, choice.offset = completion_logprobs(ids, entries, self.texts, offset=choice.offset)
        return out

    def body_json(self) -> dict[str, Any]:
        out = []
        for c in self.choices:
            logprobs = self._logprobs(c, c.tokens, prompt=True)
            text = c.echo_text + "".join(c.parts)
            finish = c.finish_reason
            reasoning = None
            if self.chat and self.prepared.reasoning is not None:
                reasoning, text = split_reasoning(text, self.prepared.reasoning)
            if self.chat and self._calls_tools:
                assert self.prepared.tools is not None  # _calls_tools says so
                message, finish = tool_message(text, self.prepared.tools, finish)
            elif self.chat:
                message = {"role": "assistant", "content": text}
            if self.chat:
                if reasoning is not None:
                    message["reasoning_content"] = reasoning
                item = {"index": c.index, "message": message, "logprobs": logprobs}
            else:
                item = {"index": c.index, "text": text, "logprobs": logprobs}
            out.append({**item, "finish_reason": finish})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": out, "usage": self.usage()}

    def chunk(
        self,
        choice: Choice,
        text: str | None,
        finish_reason: str | None,
        tokens: list[TokenLogprob],
        *,
        role: bool = False,
        prompt: bool = False,
    ) -> str:
        logprobs = None if role else self._logprobs(choice, tokens, prompt=prompt)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if role:
                pass
            elif text is not None:
                final = finish_reason is not None
                if self.prepared.reasoning is not None:  # the thinking apart (`ReasoningStream`)
                    if choice.reasoning_stream is None:
                        choice.reasoning_stream = ReasoningStream(
                            self.prepared.reasoning, self.prepared.prompt_open
                        )
                    thought, text = choice.reasoning_stream.feed(text, final=final)
                    if thought:
                        delta["reasoning_content"] = thought
                if self._calls_tools:  # content and calls (`ToolStream`)
                    if choice.tool_stream is None:
                        assert self.prepared.tools is not None  # _calls_tools says so
                        choice.tool_stream = ToolStream(self.prepared.tools)
                    delta.update(choice.tool_stream.feed(text, final=final))
                    finish_reason = choice.tool_stream.finish_reason(finish_reason)
                elif text or "reasoning_content" not in delta:
                    delta["content"] = text
            item = {"index": choice.index, "delta": delta}
            head = self._head("chat.completion.chunk")
        else:
            item = {"index": choice.index, "text": text or ""}
            head = self._head("text_completion")
        item.update(logprobs=logprobs, finish_reason=finish_reason)
        data = {**head, "choices": [item]}
        if self._include_usage:
            data["usage"] = None
        return _sse(data)

    def usage_chunk(self) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse({**self._head(obj), "choices": [], "usage": self.usage()})

    @property
    def _calls_tools(self) -> bool:
        tools = self.prepared.tools
        return tools is not None and tools.mode != "none"

    @property
    def _include_usage(self) -> bool:
        options = self.body.stream_options
        return bool(options and options.include_usage)

    def lives(self) -> list[LiveRequest]:
        return [c.live for c in self.choices if c.live is not None]


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _error_event(message: str) -> str:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return f"data: {json.dumps(body)}\n\n"


def _failure(event: TokenEvent) -> str:
    if event.finish_reason == "cancelled":
        return "the request was cancelled: the server is shutting down"
    return f"generation failed: {event.error or 'engine error'}"


def _cancel(loop: EngineLoop, gen: Generation) -> None:
    for live in gen.lives():
        if live.sink is not None:
            loop.cancel(live)


async def _watch_disconnect(
    http: HttpRequest, loop: EngineLoop, gen: Generation, queue: asyncio.Queue
) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            _cancel(loop, gen)
            queue.put_nowait((None, _DISCONNECTED))
            return


def _submit(gen: Generation, loop: EngineLoop, queue: asyncio.Queue) -> None:
    """Every choice's request into the loop; if one is refused (429, 503), those already in are
    cancelled and the refusal is the answer."""
    submitted: list[LiveRequest] = []
    try:
        for choice in gen.choices:
            if choice.live is None:
                choice.finish_reason = "length"  # echo only: the token limit, 0, is reached
                continue
            choice.live.sink = _ChoiceSink(queue, choice.index)
            loop.submit(choice.live)
            submitted.append(choice.live)
    except ServerError:
        for live in submitted:
            loop.cancel(live)
        raise


def _take(gen: Generation, index: int, event: TokenEvent) -> Choice:
    choice = gen.choices[index]
    choice.parts.append(event.text)
    choice.tokens.extend(event.logprobs)
    choice.completion_tokens = event.completion_tokens
    choice.finish_reason = event.finish_reason
    return choice


async def respond(gen: Generation, http: HttpRequest, loop: EngineLoop) -> Response:
    """Submit `gen`'s choices (a 429/503 `ServerError` when the loop will not take them) and
    answer."""
    queue: asyncio.Queue = asyncio.Queue()
    _submit(gen, loop, queue)
    watcher = asyncio.create_task(_watch_disconnect(http, loop, gen, queue))
    if gen.body.stream:
        return StreamingResponse(
            _stream(gen, loop, queue, watcher),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    running = len(gen.lives())
    failed: TokenEvent | None = None
    try:
        while running and failed is None:
            index, event = await queue.get()
            if event.finish_reason in ("cancelled", "error"):
                failed = event
                break
            _take(gen, index, event)
            running -= event.finish_reason is not None
    finally:
        watcher.cancel()
        if running:
            _cancel(loop, gen)
    if failed is not None:
        status = 503 if failed.finish_reason == "cancelled" else 500
        raise ServerError(_failure(failed), status=status, type="server_error")
    return JSONResponse(gen.body_json())


async def _stream(
    gen: Generation, loop: EngineLoop, queue: asyncio.Queue, watcher: asyncio.Task
) -> AsyncIterator[str]:
    running = len(gen.lives())
    try:
        for choice in gen.choices:
            if gen.chat:
                yield gen.chunk(choice, None, None, [], role=True)
            elif gen.prepared.echo:  # the prompt first; an echo-only choice ends with it
                yield gen.chunk(choice, choice.echo_text, choice.finish_reason, [], prompt=True)
        while running:
            index, event = await queue.get()
            if event is _DISCONNECTED:
                return
            if event.finish_reason in ("cancelled", "error"):
                yield _error_event(_failure(event))
                break
            # One chunk per generated token; each choice's last carries its finish reason.
            choice = _take(gen, index, event)
            yield gen.chunk(choice, event.text, event.finish_reason, list(event.logprobs))
            running -= event.finish_reason is not None
        if gen._include_usage and not running:
            yield gen.usage_chunk()
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        if running:
            _cancel(loop, gen)

"""/v1/completions and /v1/chat/completions: submit to the engine loop, answer in OpenAI's
shape, as one JSON body or as server-sent events (one `data: {...}` chunk per generated token,
the last with the finish reason, then `data: [DONE]`).

A watcher task listens for the client's disconnect while a request runs; when it comes, the
request is cancelled, so its KV slot is freed at the engine's next step even if it was still
waiting and had produced nothing to write.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from quantkit.http_api.engine_loop import EngineLoop, LiveRequest, TokenEvent
from quantkit.http_api.prepare import Prepared
from quantkit.http_api.protocol import ChatCompletionRequest, CompletionRequest, ServerError

__all__ = ["Generation", "respond"]

_DISCONNECTED = TokenEvent("", "cancelled", 0)


@dataclass
class Generation:
    """One request in flight: what was asked and the engine's view of it."""

    body: CompletionRequest | ChatCompletionRequest
    prepared: Prepared
    live: LiveRequest
    model_name: str

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.prepared.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def body_json(self, text: str, finish_reason: str, tokens: int) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": self.usage(tokens)}

    def chunk(self, text: str | None, finish_reason: str | None, *, role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None and not role:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            head = self._head("chat.completion.chunk")
        else:
            choice = {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            head = self._head("text_completion")
        data = {**head, "choices": [choice]}
        if self._include_usage:
            data["usage"] = None
        return _sse(data)

    def usage_chunk(self, tokens: int) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse({**self._head(obj), "choices": [], "usage": self.usage(tokens)})

    @property
    def _include_usage(self) -> bool:
        options = self.body.stream_options
        return bool(options and options.include_usage)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _error_event(message: str) -> str:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return f"data: {json.dumps(body)}\n\n"


def _failure(event: TokenEvent) -> str:
    if event.finish_reason == "cancelled":
        return "the request was cancelled: the server is shutting down"
    return f"generation failed: {event.error or 'engine error'}"


async def _watch_disconnect(http: HttpRequest, loop: EngineLoop, live: LiveRequest) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            loop.cancel(live)
            live.sink.put_nowait(_DISCONNECTED)
            return


async def respond(gen: Generation, http: HttpRequest, loop: EngineLoop) -> Response:
    """Submit `gen` (a 429/503 `ServerError` when the loop will not take it) and answer."""
    gen.live.sink = asyncio.Queue()
    loop.submit(gen.live)
    watcher = asyncio.create_task(_watch_disconnect(http, loop, gen.live))
    if gen.body.stream:
        return StreamingResponse(
            _stream(gen, loop, watcher),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    done = False
    try:
        parts: list[str] = []
        while True:
            event: TokenEvent = await gen.live.sink.get()
            parts.append(event.text)
            if event.finish_reason is not None:
                done = True
                break
    finally:
        watcher.cancel()
        if not done:
            loop.cancel(gen.live)
    if event.finish_reason in ("cancelled", "error"):
        status = 503 if event.finish_reason == "cancelled" else 500
        raise ServerError(_failure(event), status=status, type="server_error")
    return JSONResponse(gen.body_json("".join(parts), event.finish_reason, event.completion_tokens))


async def _stream(gen: Generation, loop: EngineLoop, watcher: asyncio.Task) -> AsyncIterator[str]:
    done = False
    try:
        if gen.chat:
            yield gen.chunk(None, None, role=True)
        while True:
            event: TokenEvent = await gen.live.sink.get()
            if event is _DISCONNECTED:
                return
            if event.finish_reason in ("cancelled", "error"):
                done = True
                yield _error_event(_failure(event))
                break
            # One chunk per generated token; the last one carries the finish reason.
            yield gen.chunk(event.text, event.finish_reason)
            if event.finish_reason is not None:
                done = True
                if gen._include_usage:
                    yield gen.usage_chunk(event.completion_tokens)
                break
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        if not done:
            loop.cancel(gen.live)

"""The FastAPI application: routes, API-key check, OpenAI-shaped errors, metrics, lifespan.

`create_app(ServerSettings(...), loaded)` builds it around an already-loaded model; its lifespan
starts the engine loop (`engine_loop.EngineLoop`) on the running event loop and, at shutdown
(after uvicorn has drained the open connections), stops it. Every error a request can cause
becomes {"error": {"message", "type", "param", "code"}} with its 4xx; an unexpected exception in
a handler is a 500 in the same shape, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quantkit.batching.types import EngineConfig
from quantkit.grammar.reasoning import ReasoningGate
from quantkit.http_api.engine_loop import EngineLoop, LiveRequest, TokenEvent
from quantkit.http_api.generation import Choice, Generation, respond
from quantkit.http_api.logprobs import TokenTexts
from quantkit.http_api.prepare import GrammarCache, Prepared, prepare
from quantkit.http_api.prometheus import CONTENT_TYPE_LATEST, ServerMetrics
from quantkit.http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ServerError,
    error_body,
)
from quantkit.runtime.loader import LoadedModel
from quantkit.runtime.scoring import prompt_logprobs
from quantkit.runtime.speculate import SpecConfig

__all__ = ["ServerSettings", "create_app"]


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    context: int  # KV positions per slot: prompt + max_tokens must fit
    eos_ids: frozenset[int]
    batch_cap: int = 8
    chunk: int | None = 64
    max_queue: int = 64
    api_key: str | None = None
    drain_s: float = 30.0
    compile_timeout_s: float = 30.0
    speculate: SpecConfig | None = None
    prefix_cache_mb: float = 0.0
    batch_invariant: bool = False


class _CountStatus:
    """Counts every HTTP response by status (pure ASGI: streaming is left alone)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def _error(status: int, message: str, **fields: Any) -> JSONResponse:
    headers = fields.pop("headers", None)
    return JSONResponse(error_body(message, **fields), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        got = first.get("input")
        shown = "none" if got is None else repr(got)[:80]
        return f"expected a JSON object body (Content-Type: application/json), got {shown}", None
    param = ".".join(loc) or None
    got = first.get("input")
    got_text = "" if isinstance(got, dict) else f", got {got!r}"
    return f"{param or 'body'}: {first['msg']}{got_text}", param


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def _server_error(_: HttpRequest, e: ServerError) -> JSONResponse:
        return _error(
            e.status, e.message, type=e.type, param=e.param, code=e.code, headers=e.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return _error(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def _http(_: HttpRequest, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), type=kind, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(_: HttpRequest, e: Exception) -> JSONResponse:
        return _error(500, f"internal error: {e!r}", type="server_error")


def create_app(settings: ServerSettings, loaded: LoadedModel) -> FastAPI:
    metrics = ServerMetrics(slots=settings.batch_cap)
    grammars = GrammarCache(loaded, set(settings.eos_ids), timeout_s=settings.compile_timeout_s)
    # Shared by the lifespan, which sets both, and the routes, which read them.
    state: dict[str, Any] = {"loop": None, "closing": False}
    lifespan = _lifespan(settings, loaded, metrics, state)
    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(_CountStatus, metrics=metrics)
    _install_errors(app)
    # The key is checked before the body is validated: no key, no details.
    guarded = [Depends(_authorizer(settings))]
    _add_generation_routes(app, settings, loaded, grammars, state, guarded)
    _add_info_routes(app, settings, metrics, state, guarded)
    return app


def _lifespan(
    settings: ServerSettings, loaded: LoadedModel, metrics: ServerMetrics, state: dict[str, Any]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine loop runs from startup until shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop = _start_engine(settings, loaded, metrics, asyncio.get_running_loop())
        state["loop"] = loop
        try:
            yield
        finally:
            # uvicorn has drained (or given up on) the connections by now.
            state["closing"] = True
            await asyncio.to_thread(loop.shutdown, deadline_s=1.0)

    return lifespan


def _start_engine(
    settings: ServerSettings,
    loaded: LoadedModel,
    metrics: ServerMetrics,
    running: asyncio.AbstractEventLoop,
) -> EngineLoop:
    """Start the engine on its own thread; its token events are handed to the requests' queues
    on `running`, the server's event loop (asyncio queues are not thread-safe)."""

    def dispatch(batch: list[tuple[LiveRequest, TokenEvent]]) -> None:
        for live, event in batch:
            if live.sink is not None:
                live.sink.put_nowait(event)

    def deliver(batch: list[tuple[LiveRequest, TokenEvent]]) -> None:
        try:
            running.call_soon_threadsafe(dispatch, batch)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    loop = EngineLoop(
        loaded.model,
        EngineConfig(
            batch_cap=settings.batch_cap,
            chunk=settings.chunk,
            speculate=settings.speculate,
            prefix_cache_mb=settings.prefix_cache_mb,
            batch_invariant=settings.batch_invariant,
        ),
        max_len=settings.context,
        max_queue=settings.max_queue,
        deliver=deliver,
        observer=metrics,
    )
    loop.start()
    return loop


def _engine(state: dict[str, Any]) -> EngineLoop:
    loop = state["loop"]
    if loop is None or state["closing"]:
        raise ServerError("the server is shutting down", status=503, type="server_error")
    return loop


def _authorizer(settings: ServerSettings) -> Callable[[HttpRequest], None]:
    """The routes' dependency that checks the API key (none set: every request passes)."""

    def authorize(http: HttpRequest) -> None:
        if settings.api_key is None:
            return
        header = http.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), settings.api_key.encode()
        ):
            what = "no API key" if not header else "an incorrect API key"
            raise ServerError(
                f"expected a valid API key as 'Authorization: Bearer KEY', got {what}",
                status=401,
                code="invalid_api_key",
            )

    return authorize


def _check_model(settings: ServerSettings, name: str) -> None:
    if name != settings.model_name:
        raise ServerError(
            f"The model `{name}` does not exist; this server serves `{settings.model_name}`",
            status=404,
            param="model",
            code="model_not_found",
        )


def _add_generation_routes(
    app: FastAPI,
    settings: ServerSettings,
    loaded: LoadedModel,
    grammars: GrammarCache,
    state: dict[str, Any],
    guarded: list[Any],
) -> None:
    """POST /v1/completions and /v1/chat/completions: one request into the engine, answered
    as JSON or as a stream of server-sent events."""

    async def generate(
        body: CompletionRequest | ChatCompletionRequest, http: HttpRequest
    ) -> Response:
        _check_model(settings, body.model)
        loop = _engine(state)
        prepared = prepare(
            body,
            tokenizer=loaded.tokenizer,
            vocab=loaded.model.config.vocab_size,
            context=settings.context,
            slots=settings.batch_cap,
        )
        choices = await _choices(body, prepared, settings, loaded, grammars, loop)
        texts = TokenTexts(loaded.tokenizer)
        gen = Generation(body, prepared, choices, settings.model_name, texts)
        return await respond(gen, http, loop)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        return await generate(body, http)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        return await generate(body, http)


async def _choices(
    body: CompletionRequest | ChatCompletionRequest,
    prepared: Prepared,
    settings: ServerSettings,
    loaded: LoadedModel,
    grammars: GrammarCache,
    loop: EngineLoop,
) -> list[Choice]:
    """n choices per prompt, each its own engine request (its own seed, penalties and grammar
    state); with echo and logprobs, each prompt scored once on the engine thread
    (`scoring.prompt_logprobs`, the PyTorch forward `quantkit lm-eval` scores with)."""
    choices = []
    for p, (prompt, limit) in enumerate(zip(prepared.prompts, prepared.max_tokens, strict=True)):
        scores = None
        if prepared.echo and prepared.logprobs is not None:
            job = loop.call(partial(prompt_logprobs, ids=prompt, top=prepared.logprobs))
            scores = await asyncio.wrap_future(job)
        for j in range(prepared.n):
            live = None
            if limit > 0:
                processors = prepared.processors(prompt)
                grammar = None
                if prepared.tools is not None:
                    grammar = await asyncio.to_thread(
                        grammars.tool_processor, prepared.tools, max_tokens=limit,
                        greedy=prepared.params.greedy,
                    )  # fmt: skip
                elif body.response_format is not None or body.structured_outputs is not None:
                    grammar = await asyncio.to_thread(
                        grammars.processor, body, max_tokens=limit, greedy=prepared.params.greedy
                    )
                if prepared.reasoning is not None:  # thinking first, then the grammar
                    vocabulary = await asyncio.to_thread(grammars.vocabulary)
                    grammar = ReasoningGate(
                        grammar, vocabulary, prepared.reasoning, max_new_tokens=limit,
                        budget=prepared.reasoning_budget, prompt_open=prepared.prompt_open,
                    )  # fmt: skip
                if grammar is not None:
                    processors.append(grammar)
                live = LiveRequest(
                    prompt,
                    max_tokens=limit,
                    params=replace(prepared.params, seed=prepared.seed(j)),
                    tokenizer=loaded.tokenizer,
                    eos_ids=set() if body.ignore_eos else set(settings.eos_ids),
                    processors=processors,
                    device=loaded.model.device,
                    logprobs=prepared.logprobs,
                )
            echo = prepared.texts[p] if prepared.echo else ""
            choices.append(Choice(p * prepared.n + j, live, echo, prompt, scores))
    return choices


def _add_info_routes(
    app: FastAPI,
    settings: ServerSettings,
    metrics: ServerMetrics,
    state: dict[str, Any],
    guarded: list[Any],
) -> None:
    """GET /v1/models (and one model's card), /health and /metrics."""
    started = int(time.time())

    def model_card() -> dict[str, Any]:
        return {
            "id": settings.model_name,
            "object": "model",
            "created": started,
            "owned_by": "quantkit",
            "max_model_len": settings.context,
        }

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=guarded)
    async def model(name: str) -> dict[str, Any]:
        _check_model(settings, name)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        loop = state["loop"]
        ok = loop is not None and not state["closing"] and loop.error is None
        return JSONResponse(
            {
                "status": "ok" if ok else "unavailable",
                "model": settings.model_name,
                "batch_cap": settings.batch_cap,
                "chunk": settings.chunk,
                "context": settings.context,
                "running": loop.running if loop else 0,
                "waiting": loop.waiting if loop else 0,
            },
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

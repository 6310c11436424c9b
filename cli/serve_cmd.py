"""`quantkit serve [MODEL_OR_CKPT]`: an OpenAI-compatible HTTP server (/v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics) on the continuous-batching engine, with
`response_format` JSON schemas through the grammar layer (see `quantkit.http_api`)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import click

from quantkit.cli.options import Runtime, load, runtime_options
from quantkit.errors import GenerationError, MissingExtraError
from quantkit.grammar.compiler import DEFAULT_TIMEOUT_S
from quantkit.runtime.describe import device_name
from quantkit.runtime.fast_path import pytorch_path_reason
from quantkit.runtime.generate import eos_token_ids

# KV positions per slot when --context is not given: the model's window, at most this (the
# cache holds batch_cap x context positions of every layer; 2048 keeps the embedded model's
# cache of 8 slots under 0.8 GB in fp32).
DEFAULT_CONTEXT = 2048


def _require_extra() -> None:
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            raise MissingExtraError(module, "serve") from None


def _at_least(value: int | None, option: str, floor: int) -> None:
    if value is not None and value < floor:
        raise GenerationError(f"{option}: expected an integer >= {floor}, got {value}")


T = TypeVar("T")


def _off_main_thread(fn: Callable[[], T]) -> T:
    """Run `fn` on a short-lived thread and return its result (re-raising its error).

    libgomp keeps one worker pool per thread that has run a parallel region, and once the
    process manages more OpenMP threads than there are cores it throttles every pool's spin-wait,
    so each parallel region wakes its workers through the kernel. Loading the model on the main
    thread left such a pool behind, and the engine thread's decode then ran at 32 tok/s against
    112 on the main thread (embedded INT4, 2 cores, quiet machine). A thread that exits takes its
    pool with it: loading here leaves the engine thread the only pool."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            err.append(e)

    worker = threading.Thread(target=run, name="quantkit-load")
    worker.start()
    worker.join()
    if err:
        raise err[0]
    return out[0]


@click.command("serve")
@click.argument("model", required=False, metavar="[MODEL_OR_CKPT]")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="0 = any free port.")
@click.option("--batch-cap", type=int, default=8, show_default=True, help="KV slots.")
@click.option(
    "--chunk",
    type=int,
    default=32,
    show_default=True,
    help="Chunked prefill: prompt tokens per step (they ride in the step's decode call, so "
    "this bounds the gap between a running request's tokens); 0 = whole prompts.",
)
@click.option(
    "--max-queue",
    type=int,
    default=64,
    show_default=True,
    help="Most requests waiting for a slot; more get 429 with Retry-After.",
)
@click.option("--context", type=int, default=None, help="Prompt + output tokens per request.")
@click.option(
    "--api-key",
    envvar="QUANTKIT_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1 (or set QUANTKIT_API_KEY).",
)
@click.option("--served-model-name", default=None, help="The model id clients send.")
@click.option(
    "--drain-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds SIGTERM waits for in-flight requests before cancelling them.",
)
@click.option(
    "--compile-timeout",
    type=float,
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    help="Seconds a response_format schema may take to compile.",
)
@runtime_options(serving=True)
@click.option("--log-level", default="warning", show_default=True, help="uvicorn's log level.")
def serve_cmd(
    model: str | None,
    host: str,
    port: int,
    batch_cap: int,
    chunk: int,
    max_queue: int,
    context: int | None,
    api_key: str | None,
    served_model_name: str | None,
    drain_timeout: float,
    compile_timeout: float,
    log_level: str,
    runtime: Runtime,
) -> None:
    """Serve MODEL_OR_CKPT (default: the embedded model as INT4) over OpenAI's API."""
    _require_extra()
    from quantkit.http_api.app import ServerSettings, create_app
    from quantkit.http_api.run import bind, serve

    _at_least(batch_cap, "--batch-cap", 1)
    _at_least(chunk, "--chunk", 0)
    _at_least(max_queue, "--max-queue", 0)
    _at_least(context, "--context", 2)
    if not drain_timeout >= 0:
        raise GenerationError(f"--drain-timeout: expected seconds >= 0, got {drain_timeout}")
    spec = runtime.speculation()
    prefix_cache_mb = runtime.prefix_cache()
    runtime.set_threads()
    sock = bind(host, port)  # a port in use fails now, not after the model loads
    dev = runtime.torch_device()
    options = runtime.options(dev)
    loaded = _off_main_thread(lambda: load(model, options))
    if runtime.batch_invariant and (why := pytorch_path_reason(loaded.model)) is not None:
        raise GenerationError(
            f"--batch-invariant: expected a model on the C decode step, got the PyTorch path: {why}"
        )
    if loaded.tokenizer is None:
        raise GenerationError(f"{loaded.path}: expected a model with a tokenizer, got none")
    window = loaded.model.config.max_position_embeddings
    ctx = min(window, DEFAULT_CONTEXT) if context is None else context
    if ctx > window:
        raise GenerationError(f"--context: expected at most {window} (the model's), got {ctx}")
    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    name = served_model_name or loaded.path.name
    settings = ServerSettings(
        model_name=name,
        context=ctx,
        eos_ids=frozenset(eos),
        batch_cap=batch_cap,
        chunk=chunk or None,
        max_queue=max_queue,
        api_key=api_key,
        drain_s=drain_timeout,
        compile_timeout_s=compile_timeout,
        speculate=spec,
        prefix_cache_mb=prefix_cache_mb,
        batch_invariant=runtime.batch_invariant,
    )
    app = create_app(settings, loaded)
    bound_host, bound_port = sock.getsockname()[:2]
    click.echo(
        f"serving {name} ({loaded.describe()}) on {device_name(dev)}: batch cap {batch_cap}, "
        f"chunk {chunk or 'off'}, context {ctx}, queue {max_queue}, speculate "
        f"{spec.describe() if spec else 'off'}, prefix cache "
        f"{f'{prefix_cache_mb:g} MiB' if prefix_cache_mb else 'off'}",
        err=True,
    )
    click.echo(f"listening on http://{bound_host}:{bound_port}", err=True)
    sys.stderr.flush()
    serve(app, sock, drain_s=drain_timeout, log_level=log_level)
    click.echo("server stopped", err=True)

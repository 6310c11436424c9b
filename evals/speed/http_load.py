"""Replay a serving workload over HTTP: the load generator behind `quantkit bench --server URL`.

The requests are the same seeded ones `quantkit bench` feeds the engine in process
(`quantkit.batching.workload`): each is sent as token ids to /v1/completions at its arrival time
(relative to the start of the run), greedy, streamed, with `ignore_eos` so that it produces
exactly its output length, as in process. At most `clients` requests are open at once (one
thread and one connection each); a request that finds every client busy waits for one, and that
wait counts in its TTFT, as queueing in the engine does.

Each streamed chunk is one token (see `quantkit.http_api.generation`), timed when its line
arrives, so the result is a `RunResult` that `quantkit.batching.metrics.summarize` turns into the
same table as an in-process run: throughput, TTFT and TPOT percentiles, goodput. Only the stdlib
is used (http.client in threads): the client must cost the machine as little as possible, since
on a small CPU it shares the cores with the server.
"""

from __future__ import annotations

import http.client
import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from quantkit.batching.metrics import summarize
from quantkit.batching.types import EngineConfig, RequestResult, RunResult
from quantkit.batching.workload import Request, make_workload
from quantkit.evals.speed.serving import BenchConfig
from quantkit.http_api.protocol import ServerError

__all__ = ["ServerInfo", "probe", "replay", "warm_up"]


@dataclass(frozen=True)
class ServerInfo:
    url: str
    model: str
    batch_cap: int
    chunk: int | None
    context: int


class _Target:
    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ServerError(f"--server: expected http://HOST:PORT, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.url = f"http://{self.host}:{self.port}"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def get(self, path: str) -> Any:
        conn = self.connect()
        try:
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            body = resp.read()
        except OSError as e:
            raise ServerError(f"--server {self.url}: expected a running server, got {e}") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise ServerError(f"--server {self.url}{path}: got HTTP {resp.status}: {body[:200]!r}")
        return json.loads(body)


def probe(url: str, *, api_key: str | None = None) -> ServerInfo:
    """What the server runs (/health and /v1/models); a clear error when nothing answers.

    llama.cpp's `llama-server` answers /health with its status alone; its slots and context
    come from its /props instead (no chunked prefill to report)."""
    target = _Target(url, api_key, 30)
    health = target.get("/health")
    model = target.get("/v1/models")["data"][0]["id"]
    if "batch_cap" not in health:
        props = target.get("/props")
        context = props.get("default_generation_settings", {}).get("n_ctx", 0)
        return ServerInfo(target.url, model, int(props.get("total_slots", 1)), None, int(context))
    return ServerInfo(target.url, model, health["batch_cap"], health["chunk"], health["context"])


def _closing(choice: dict[str, Any], usage: dict[str, Any] | None) -> bool:
    """A chunk that only closes the stream: the finish reason and the usage, no text.
    `quantkit serve` puts the finish reason on the last token's chunk and the usage on a chunk
    of its own, so none of its chunks is one; llama.cpp's llama-server sends the last token with
    no finish reason, then one of these."""
    return bool(choice.get("finish_reason") and not choice.get("text") and usage)


def _one(
    target: _Target, model: str, request: Request, start: float, result: RequestResult
) -> None:
    body = {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.max_new_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    delay = start + request.arrival_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    conn = target.connect()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), target.headers)
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            result.finish_reason = "rejected"
            return
        while line := resp.readline():
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter() - start
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            choices = chunk.get("choices")
            if choices and _closing(choices[0], chunk.get("usage")):
                result.finish_reason = choices[0]["finish_reason"]
                result.finish_s = now
            elif choices:  # one chunk per token
                result.tokens.append(-1)  # ids do not travel; the count does
                result.token_times_s.append(now)
                if choices[0].get("finish_reason"):
                    result.finish_reason = choices[0]["finish_reason"]
                    result.finish_s = now
            elif "error" in chunk:
                result.finish_reason = "rejected"
                return
    except OSError:
        result.finish_reason = "rejected"
    finally:
        conn.close()


def replay(
    info: ServerInfo,
    requests: Sequence[Request],
    *,
    clients: int,
    api_key: str | None = None,
    timeout_s: float = 600.0,
) -> RunResult:
    """Send `requests` to the server (see the module docstring); what happened to each."""
    target = _Target(info.url, api_key, timeout_s)
    results = [RequestResult(r.id, r.arrival_s, len(r.prompt)) for r in requests]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients, thread_name_prefix="loadgen") as pool:
        futures = [
            pool.submit(_one, target, info.model, r, start, res)
            for r, res in zip(requests, results, strict=True)
        ]
        for f in futures:
            f.result()
    done = [r for r in results if r.token_times_s]
    end = max((r.token_times_s[-1] for r in done), default=time.perf_counter() - start)
    return RunResult(
        requests=results,
        decode_steps=[],
        prefill_chunks=[],
        config=EngineConfig(batch_cap=info.batch_cap, chunk=info.chunk),
        start_s=min((r.arrival_s for r in requests), default=0.0),
        end_s=end,
    )


def warm_up(info: ServerInfo, request: Request, *, api_key: str | None = None) -> None:
    """One short request first, as the in-process bench warms up before timing."""
    short = Request(request.id, request.prompt, min(request.max_new_tokens, 4), 0.0)
    replay(info, [short], clients=1, api_key=api_key)


def bench_over_http(
    info: ServerInfo,
    config: BenchConfig,
    *,
    vocab_size: int,
    max_total: int,
    source_tokens: Sequence[int] | None,
    clients: int,
    api_key: str | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """`quantkit bench --server URL`: the base workload of `config` at each of its rates,
    replayed against the server `info` describes, one record per rate in the shape of the
    in-process bench's (`quantkit.evals.speed.serving`), so one table shows both. The prompts
    are the very token ids the in-process bench feeds the engine (`vocab_size`, `max_total` and
    `source_tokens` come from the served model's config and tokenizer)."""
    records = []
    for rate in config.rates:
        spec = config.workload(rate, long=False)
        requests = make_workload(
            spec, vocab_size=vocab_size, max_total=max_total, source_tokens=source_tokens
        )
        warm_up(info, requests[0], api_key=api_key)
        run = replay(info, requests, clients=clients, api_key=api_key)
        done = [r for r in run.requests if r.token_times_s]
        record = {
            "mode": "http",
            "batch_cap": info.batch_cap,
            "rate": "inf" if math.isinf(rate) else rate,
            "chunked_prefill": info.chunk is not None,
            "chunk": info.chunk,
            "long_prompts": False,
            "workload": spec.describe(),
            "clients": clients,
            **summarize(run, slo=config.slo).to_dict(),
            "samples": {
                "ttft_ms": [round(1e3 * r.ttft_s, 3) for r in done],
                "tpot_ms": [round(1e3 * g, 3) for r in done for g in r.gaps_s],
            },
        }
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records

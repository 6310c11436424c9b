"""`quantkit serve` end to end: a real server in a subprocess on a free port, driven with the
official openai client (and raw HTTP where a client would hide what is tested).

The model is a tiny random Llama with a real BPE tokenizer and a chat template: its text is
nonsense, but every property tested here (wire format, batching invariance, grammar, stop
strings, seeds, cancellation, queueing, draining) does not depend on the weights.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from tests.conftest import make_hf_model, make_tokenizer, run_cli  # noqa: E402

KEY = "sk-test-key"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [
    "Beautiful is better than",
    "Explicit is better than implicit.",
    "Simple is better",
    "Flat is better than nested",
    "Sparse",
    "Readability counts. Special cases",
    "Errors should never pass silently",
    "In the face of ambiguity, refuse",
]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    host: str
    port: int
    model: str
    log: list[str]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def raw(self, method: str, path: str, body: object = None, **headers: str):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **headers}
        conn.request(method, path, body=data, headers={k: v for k, v in hdrs.items() if v})
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, dict(resp.getheaders()), text

    def metric(self, name: str) -> float:
        _, _, text = self.raw("GET", "/metrics")
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match[1])


def make_chat_model(path: Path) -> Path:
    """The serving tests' model at `path`: a tiny random Llama (1024 positions), a real BPE
    tokenizer, CHAT_TEMPLATE."""
    make_hf_model(path, {"hidden_size": 64, "max_position_embeddings": 1024})
    make_tokenizer(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("serve-model"))


def _start(model_dir: Path, home: Path, *args: str) -> Server:
    env = {**os.environ, "QUANTKIT_HOME": str(home), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "quantkit.cli.main", "serve", str(model_dir), "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--threads", "1", *args], env=env, stderr=subprocess.PIPE, text=True
    )
    log: list[str] = []
    deadline = time.monotonic() + 120
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"server exited {proc.wait()}:\n{''.join(log)}")
        log.append(line)
        if match := re.search(r"listening on (http://([\d.]+):(\d+))", line):
            url, host, port = match[1], match[2], int(match[3])
        assert time.monotonic() < deadline, "".join(log)
    # Keep draining stderr so the server never blocks on a full pipe.
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    server = Server(proc, url, host, port, model_dir.name, log)
    while True:  # the lifespan starts the engine just after the socket is up
        try:
            if server.raw("GET", "/health")[0] == 200:
                return server
        except OSError:
            pass
        assert time.monotonic() < deadline, "".join(log)
        time.sleep(0.05)


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("home")
    s = _start(model_dir, home, "--batch-cap", "4", "--max-queue", "16", "--api-key", KEY)
    yield s
    _stop(s)


def _complete(server: Server, prompt: str, max_tokens: int = 12, **kw: object):
    return server.client().completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


# --------------------------------------------------------------------------- the API


def test_models_health_and_completion(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    status, _, body = server.raw("GET", "/health")
    assert status == 200 and json.loads(body)["batch_cap"] == 4
    out = _complete(server, PROMPTS[0], extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert choice.text and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_chat_and_streaming_agree(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Now is better than never."}]
    kw = {"model": server.model, "messages": messages, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Completions stream too, one chunk per token.
    parts = list(
        server.client().completions.create(
            model=server.model, prompt=PROMPTS[1], max_tokens=7, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert len(parts) == 7 and parts[-1].choices[0].finish_reason == "length"
    assert (
        "".join(p.choices[0].text for p in parts)
        == _complete(server, PROMPTS[1], 7, extra_body={"ignore_eos": True}).choices[0].text
    )


def test_concurrent_greedy_equals_alone(server: Server) -> None:
    """16 clients at once (4 slots, the rest queued) each get what they get alone."""
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    kw = {"extra_body": {"ignore_eos": True}}
    alone = [_complete(server, p, 16, **kw).choices[0].text for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _complete(server, p, 16, **kw).choices[0].text, prompts))
    assert together == alone


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
OTHER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}


def test_json_schema_per_request(server: Server) -> None:
    """Two schemas in one batch (and an unconstrained request beside them): each output
    validates against its own schema."""
    client = server.client()

    def ask(schema: dict | None) -> tuple[dict | None, str]:
        fmt = None
        if schema is not None:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        out = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Answer in JSON."}],
            max_tokens=60, temperature=0, response_format=fmt or openai.NOT_GIVEN,
        )  # fmt: skip
        assert out.choices[0].finish_reason == "stop" or schema is None
        return schema, out.choices[0].message.content

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(ask, [SCHEMA, OTHER, None, SCHEMA]))
    for schema, text in results:
        if schema is not None:
            jsonschema.validate(json.loads(text), schema)


def test_json_object(server: Server) -> None:
    out = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=120, temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_unsupported_schema_is_400_before_generating(server: Server) -> None:
    before = server.metric("quantkit_generated_tokens_total")
    schema = {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}},
        )  # fmt: skip
    assert "dependentSchemas" in err.value.message
    assert err.value.body["param"] == "response_format"
    assert server.metric("quantkit_generated_tokens_total") == before


def test_stop_strings(server: Server) -> None:
    full = _complete(server, PROMPTS[2], 20, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), full
    cut = full[: full.index(stop)]
    out = _complete(server, PROMPTS[2], 20, stop=[stop, "\x00never"]).choices[0]
    assert out.finish_reason == "stop" and out.text == cut
    streamed = server.client().completions.create(
        model=server.model, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=stop,
        stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_seed_reproducible(server: Server) -> None:
    def sampled(seed: int) -> str:
        return server.client().completions.create(
            model=server.model, prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"top_k": 50, "ignore_eos": True},
        ).choices[0].text  # fmt: skip

    with ThreadPoolExecutor(3) as pool:  # batched with each other: still the same stream
        first = list(pool.map(sampled, [7, 7, 8]))
    assert first[0] == first[1] == sampled(7)
    assert first[2] != first[0]


def _bad(server: Server) -> list[tuple[int, str | None, dict, dict]]:
    good = {"model": server.model, "prompt": "hi", "max_tokens": 4}
    msgs = {"model": server.model, "messages": [{"role": "user", "content": "hi"}]}
    return [
        (400, None, b"{not json", {}),
        (400, "max_tokens", {**good, "max_tokens": "four"}, {}),
        (400, "temperature", {**good, "temperature": -1}, {}),
        (400, "n", {**good, "n": 5}, {}),  # the batch cap is 4
        (400, "max_tokens", {**good, "max_tokens": 0}, {}),
        (400, "max_tokens", {**good, "max_tokens": -3}, {}),
        (400, "prompt", {**good, "prompt": "word " * 1100}, {}),
        (400, "max_tokens", {**good, "max_tokens": 5000}, {}),
        (400, "prompt", {**good, "prompt": [99999]}, {}),
        (400, "messages", {**msgs, "messages": []}, {}),
        (400, "logprobs", {**good, "logprobs": 21}, {}),
        (400, "top_logprobs", {**msgs, "logprobs": True, "top_logprobs": 21}, {}),
        (400, "top_logprobs", {**msgs, "top_logprobs": 2}, {}),
        (400, "presence_penalty", {**good, "presence_penalty": 2.5}, {}),
        (404, "model", {**good, "model": "gpt-4"}, {}),
        (401, None, good, {"Authorization": ""}),
        (401, None, good, {"Authorization": "Bearer wrong"}),
    ]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server: Server) -> None:
    for status, param, body, headers in _bad(server):
        path = (
            "/v1/chat/completions"
            if isinstance(body, dict) and "messages" in body
            else ("/v1/completions")
        )
        got, _, text = server.raw("POST", path, body, **headers)
        assert got == status, (body, text)
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, (body, error)
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    assert _complete(server, PROMPTS[0]).choices[0].text
    assert server.metric('quantkit_requests_total{status="400"}') >= 11


def test_disconnect_mid_stream_frees_the_slot(server: Server) -> None:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    body = {"model": server.model, "prompt": PROMPTS[4], "max_tokens": 900, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b'data: {"id"'), first  # generating
    assert server.metric("quantkit_kv_slots_in_use") >= 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 10
    while server.metric("quantkit_kv_slots_in_use") != 0:
        assert time.monotonic() < deadline, "the slot was never freed"
        time.sleep(0.05)
    assert server.metric("quantkit_generated_tokens_total") < 2000  # it stopped early
    assert _complete(server, PROMPTS[5]).choices[0].text


def test_metrics_exposition(server: Server) -> None:
    _, headers, text = server.raw("GET", "/metrics")
    assert headers["content-type"].startswith("text/plain")
    for name in (
        "quantkit_requests_total", "quantkit_time_to_first_token_seconds_bucket",
        "quantkit_time_per_output_token_seconds_bucket", "quantkit_requests_running",
        "quantkit_requests_waiting", "quantkit_kv_slots_in_use", "quantkit_generated_tokens_total",
        "quantkit_decode_steps_total",
    ):  # fmt: skip
        assert name in text, name
    assert re.search(r'quantkit_decode_steps_total\{batch_size="4"\} [1-9]', text)


# --------------------------------------------------------------------------- queue, SIGTERM


def _stream_in_thread(server: Server, max_tokens: int, results: list) -> threading.Thread:
    def run() -> None:
        chunks = list(
            server.client().completions.create(
                model=server.model, prompt="Sparse is better", max_tokens=max_tokens,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        results.append(chunks)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_queue_full_is_429_and_sigterm_drains(model_dir: Path, tmp_path: Path) -> None:
    server = _start(model_dir, tmp_path, "--batch-cap", "1", "--max-queue", "1")
    try:
        results: list = []
        first = _stream_in_thread(server, 900, results)
        while server.metric("quantkit_requests_running") < 1:
            time.sleep(0.02)
        second = _stream_in_thread(server, 20, results)
        while server.metric("quantkit_requests_waiting") < 1:
            time.sleep(0.02)
        status, headers, text = server.raw(
            "POST", "/v1/completions", {"model": server.model, "prompt": "x", "max_tokens": 2}
        )
        assert status == 429 and headers["retry-after"] == "1", text
        assert json.loads(text)["error"]["type"] == "rate_limit_error"
        server.proc.send_signal(signal.SIGTERM)  # both in-flight requests still finish
        assert server.proc.wait(timeout=60) == 0, "".join(server.log)
        first.join(10)
        second.join(10)
        assert sorted(len(chunks) for chunks in results) == [20, 900]
        assert all(chunks[-1].choices[0].finish_reason == "length" for chunks in results)
    finally:
        _stop(server)


def test_port_in_use_is_one_line(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, "serve", str(model_dir), "--port", str(port))
    assert code == 2 and err.count("\n") == 1 and "already in use" in err, err


def test_bench_over_http_reports_the_table(
    server: Server, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys, "bench", str(model_dir), "--server", server.url, "--api-key", KEY,
        "--rates", "inf", "--requests", "6", "--output-len", "4-8", "--prompts", "random",
        "--clients", "3",
    )  # fmt: skip
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("http"))
    assert row.split()[1:5] == ["4", "inf", "32", "6/6"], out


# --------------------------------------------------------------------------- fewer forwards


def test_speculation_and_prefix_cache_keep_the_completions(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An INT4 checkpoint served with --speculate and --prefix-cache-mb answers exactly what it
    answers without them (greedy), reuses a shared prompt prefix, and counts both in
    /metrics."""
    from quantkit.format.scheme import QuantScheme
    from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available
    from quantkit.quantize.pipeline import quantize_model

    if not cpu_kernel_available():
        pytest.skip("needs gcc for the C kernel")
    home = tmp_path_factory.mktemp("home-reuse")
    outcome = quantize_model(model_dir, scheme=QuantScheme("int4", "auto", False))
    ckpt = outcome.save(home / "int4", source_dir=model_dir)
    system = " ".join(PROMPTS) + " " + " ".join(PROMPTS)  # a long shared start
    prompts = [f"{system} {p}" for p in PROMPTS[:3]]
    answers = {}
    for args in ((), ("--speculate", "ngram", "--prefix-cache-mb", "16")):
        server = _start(ckpt, home, "--batch-cap", "2", "--api-key", KEY, *args)
        try:
            answers[args] = [
                _complete(server, p, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
                for p in prompts
            ]
            if args:
                assert server.metric("quantkit_prefix_cache_hit_tokens_total") >= 2 * 32
                assert server.metric("quantkit_spec_draft_tokens_total") >= 0
                assert any("speculate ngram:4" in line for line in server.log)
        finally:
            _stop(server)
    plain, reused = answers.values()
    assert reused == plain and all(plain)

"""`quantkit serve`: the rest of the OpenAI API clients and evaluation harnesses call (logprobs,
top_logprobs, echo, n, presence and frequency penalties, max_completion_tokens, include_usage),
against a real server in a subprocess, checked with an independent forward in this process.

The model is test_server.py's tiny random Llama: logprobs are checked against the model's own
forward on the same checkpoint, so the weights being random does not matter.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from quantkit.evals.accuracy.continuations import score_continuations  # noqa: E402
from quantkit.runtime.loader import LoadedModel, load_model  # noqa: E402
from quantkit.runtime.scoring import log_probs  # noqa: E402
from tests.test_server import KEY, PROMPTS, Server, _start, _stop, make_chat_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_server.py's model: a tiny random Llama, a real BPE tokenizer, a chat template."""
    return make_chat_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("home")
    s = _start(model_dir, home, "--batch-cap", "4", "--api-key", KEY)
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def local(model_dir: Path) -> LoadedModel:
    return load_model(model_dir)


def _forward_logprobs(local: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward: row t predicts token t + 1."""
    with torch.inference_mode():
        return log_probs(local.model(torch.tensor([ids]))[0])


def _greedy(local: LoadedModel, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(_forward_logprobs(local, ids)[-1].argmax()))
    return ids[len(prompt) :]


def _chat_ids(local: LoadedModel, text: str) -> list[int]:
    rendered = local.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(local.tokenizer.encode(rendered, add_special_tokens=False))


def _post(server: Server, path: str, body: dict) -> dict:
    status, _, text = server.raw("POST", path, body)
    assert status == 200, text
    return json.loads(text)


def test_chat_logprobs_equal_a_forward(server: Server, local: LoadedModel) -> None:
    client = server.client()
    # max_completion_tokens wins over max_tokens.
    out = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPTS[0]}],
        temperature=0, logprobs=True, top_logprobs=3, max_tokens=2, max_completion_tokens=6,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert out.usage.completion_tokens == len(content) == 6
    prompt = _chat_ids(local, PROMPTS[0])
    generated = _greedy(local, prompt, 6)
    expected = _forward_logprobs(local, prompt + generated)
    for i, (entry, token) in enumerate(zip(content, generated, strict=True)):
        row = expected[len(prompt) - 1 + i]
        assert entry.token == local.tokenizer.decode([token])
        assert entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - float(row[token])) < TOL
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert abs(tops[0] - entry.logprob) < TOL  # greedy: the chosen token is the best
        assert abs(tops[2] - float(row.topk(3).values[2])) < TOL


def test_completion_logprobs_and_streaming_with_usage(server: Server, local: LoadedModel) -> None:
    body = {"model": server.model, "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0,
            "logprobs": 2, "ignore_eos": True}  # fmt: skip
    whole = _post(server, "/v1/completions", body)["choices"][0]
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 5
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == whole["text"]
    prompt = list(local.tokenizer.encode(PROMPTS[1], add_special_tokens=True))
    generated = _greedy(local, prompt, 5)
    expected = _forward_logprobs(local, prompt + generated)
    for i, token in enumerate(generated):
        assert abs(lp["token_logprobs"][i] - float(expected[len(prompt) - 1 + i, token])) < TOL

    stream = server.client().completions.create(
        **{k: v for k, v in body.items() if k != "ignore_eos"}, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    tokens = [t for c in chunks[:-1] for t in (c.choices[0].logprobs.tokens or [])]
    values = [t for c in chunks[:-1] for t in (c.choices[0].logprobs.token_logprobs or [])]
    assert tokens == lp["tokens"]
    assert max(abs(a - b) for a, b in zip(values, lp["token_logprobs"], strict=True)) < TOL
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_logprobs_and_include_usage(server: Server) -> None:
    kwargs = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[2]}],
              "temperature": 0, "logprobs": True, "top_logprobs": 0, "max_tokens": 4,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = server.client().chat.completions.create(**kwargs)
    chunks = list(
        server.client().chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    streamed = [
        e for c in chunks[:-1] if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
    assert all(e.top_logprobs == [] for e in streamed)


def test_echo_scores_the_prompt_as_lm_eval_does(server: Server, local: LoadedModel) -> None:
    text = PROMPTS[5]
    ids = list(local.tokenizer.encode(text, add_special_tokens=True))
    body = {"model": server.model, "prompt": text, "max_tokens": 0, "echo": True,
            "logprobs": 1, "temperature": 0}  # fmt: skip
    out = _post(server, "/v1/completions", body)
    choice = out["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                            "total_tokens": len(ids)}  # fmt: skip
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # The in-process lm-eval scorer on the same checkpoint: the same numbers.
    for split in (1, len(ids) // 2, len(ids) - 1):
        ((scored, greedy),) = score_continuations(local.model, [ids[:split]], [[ids[split:]]])[0]
        assert abs(sum(lp["token_logprobs"][split:]) - scored) < TOL
        is_greedy = all(
            tok == max(top.values())
            for tok, top in zip(
                lp["token_logprobs"][split:], lp["top_logprobs"][split:], strict=True
            )
        )
        assert is_greedy == greedy
    # What lm_eval's local-completions sends (max_tokens 1), with a batch of two prompts: it
    # drops the last logprob, the generated token's (an EOS that ended the choice included).
    two = _post(server, "/v1/completions", {**body, "max_tokens": 1, "prompt": [text, PROMPTS[0]]})
    assert [c["index"] for c in two["choices"]] == [0, 1]
    first = two["choices"][0]["logprobs"]
    assert len(first["tokens"]) == len(ids) + 1
    assert first["token_logprobs"][:-1] == lp["token_logprobs"]
    assert two["choices"][1]["text"].startswith(PROMPTS[0])
    # Echo without logprobs, streamed: the prompt comes first.
    chunks = list(
        server.client().completions.create(
            model=server.model, prompt=text, echo=True, max_tokens=2, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].text == text


def test_scoring_between_steps_leaves_running_requests_alone(server: Server) -> None:
    body = {"model": server.model, "prompt": PROMPTS[4], "max_tokens": 60, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    alone = _post(server, "/v1/completions", body)["choices"][0]["text"]
    result: list[str] = []
    thread = threading.Thread(
        target=lambda: result.append(_post(server, "/v1/completions", body)["choices"][0]["text"])
    )
    thread.start()
    echo = {"model": server.model, "prompt": PROMPTS[3], "max_tokens": 0, "echo": True,
            "logprobs": 0}  # fmt: skip
    scores = [_post(server, "/v1/completions", echo) for _ in range(4)]
    thread.join()
    assert result == [alone]
    values = [s["choices"][0]["logprobs"]["token_logprobs"] for s in scores]
    assert all(v == values[0] for v in values)


def test_n_choices_are_independent_and_reproducible(server: Server) -> None:
    def ask(n: int, seed: int) -> list[str]:
        out = server.client().completions.create(
            model=server.model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=n, seed=seed
        )
        assert [c.index for c in out.choices] == list(range(n))
        return [c.text for c in out.choices]

    three = ask(3, 11)
    assert ask(3, 11) == three
    assert len(set(three)) > 1  # each choice its own sample
    assert ask(1, 11) == three[:1]
    chunks = list(
        server.client().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi"}], n=2,
            max_tokens=3, seed=5, stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1] and chunks[-1].choices == []


def test_penalties_over_http(server: Server) -> None:
    def tokens(**extra: object) -> list[str]:
        body = {"model": server.model, "prompt": PROMPTS[6], "max_tokens": 40, "temperature": 0,
                "logprobs": 0, "ignore_eos": True, **extra}  # fmt: skip
        return _post(server, "/v1/completions", body)["choices"][0]["logprobs"]["tokens"]

    plain = tokens()
    fewer = tokens(frequency_penalty=2.0, presence_penalty=2.0)
    more = tokens(frequency_penalty=-2.0)
    assert len(set(fewer)) >= len(set(plain)) >= len(set(more))
    assert len(set(fewer)) > len(set(more))


def test_bad_inputs_are_400_and_the_server_keeps_serving(server: Server) -> None:
    good = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 1}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {**chat, "n": 5}, "n"),
        ("/v1/completions", {**good, "n": 5}, "n"),
        ("/v1/completions", {**good, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**good, "frequency_penalty": -2.5}, "frequency_penalty"),
        ("/v1/completions", {**good, "best_of": 2}, "best_of"),
        ("/v1/completions", {**good, "max_tokens": 0}, "max_tokens"),
    ]
    for path, body, param in cases:
        status, _, text = server.raw("POST", path, body)
        assert status == 400, (body, text)
        error = json.loads(text)["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert _post(server, "/v1/completions", good)["choices"][0]["text"] is not None


def test_logprob_floor_is_json() -> None:
    from quantkit.http_api.logprobs import completion_logprobs
    from quantkit.runtime.scoring import TokenLogprob

    out, end = completion_logprobs(
        [1, 2], [None, TokenLogprob(2, -math.inf, ((1, -0.1),))], lambda t: "ab"[t - 1]
    )
    assert out["token_logprobs"] == [None, -9999.0] and end == 2
    assert out["top_logprobs"][1] == {"a": -0.1, "b": -9999.0}
    json.dumps(out, allow_nan=False)

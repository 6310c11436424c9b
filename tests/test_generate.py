"""The decode loop on tiny random models: against transformers, batching, stops, stats."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from quantkit.errors import GenerationError
from quantkit.runtime.generate import (
    StreamEvent,
    encode_prompt,
    eos_token_ids,
    generate,
)
from quantkit.runtime.loader import LoadedModel, load_model
from quantkit.runtime.sampling import SamplingParams
from quantkit.runtime.textstream import IncrementalDetokenizer, StopStringStream

GREEDY = SamplingParams(max_new_tokens=24)


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 3 up: 0-2 are the tokenizer's special tokens (2 is the config's eos).
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def test_greedy_matches_transformers(tiny: LoadedModel, tiny_model_dir: Path) -> None:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=64)
    for prompt in _prompts([5, 23, 41], seed=1):
        want = (
            ref.eval()
            .generate(
                torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None
            )[0, len(prompt) :]
            .tolist()
        )
        got = generate(tiny.model, [prompt], params)
        assert got.tokens[0] == want
        assert got.finish_reasons == ["length"]


def test_repetition_penalty_matches_transformers(tiny: LoadedModel, tiny_model_dir: Path) -> None:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    (prompt,) = _prompts([12], seed=2)
    want = (
        ref.eval()
        .generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            repetition_penalty=1.5,
            eos_token_id=None,
        )[0, len(prompt) :]
        .tolist()
    )
    got = generate(tiny.model, [prompt], SamplingParams(max_new_tokens=32, repetition_penalty=1.5))
    assert got.tokens[0] == want
    plain = generate(tiny.model, [prompt], SamplingParams(max_new_tokens=32))
    assert plain.tokens[0] != want  # the penalty changed something, so the test has teeth


def test_batch_of_different_lengths_matches_each_alone(tiny: LoadedModel) -> None:
    prompts = _prompts([3, 17, 9, 30], seed=3)
    alone = [generate(tiny.model, [p], GREEDY).tokens[0] for p in prompts]
    batched = generate(tiny.model, prompts, GREEDY)
    assert batched.tokens == alone
    assert batched.stats.batch_size == 4 and batched.stats.prompt_tokens == 59
    # A row that ends early (EOS) leaves the others untouched.
    eos = alone[1][4]
    stop_at = alone[1].index(eos)
    mixed = generate(tiny.model, prompts, GREEDY, eos_ids=[eos])
    assert mixed.tokens[1] == alone[1][:stop_at] and mixed.finish_reasons[1] == "stop"
    for row in (0, 2, 3):
        cut = alone[row].index(eos) if eos in alone[row] else len(alone[row])
        assert mixed.tokens[row] == alone[row][:cut]


def test_same_seed_same_tokens(tiny: LoadedModel) -> None:
    (prompt,) = _prompts([8], seed=4)

    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=seed, max_new_tokens=32)
        return generate(tiny.model, [prompt], params).tokens[0]

    assert run(7) == run(7)
    assert run(7) != run(8)
    # An explicit generator is used as given.
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    a = generate(tiny.model, [prompt], params, generator=torch.Generator().manual_seed(3))
    b = generate(tiny.model, [prompt], params, generator=torch.Generator().manual_seed(3))
    assert a.tokens == b.tokens


def test_eos_and_max_tokens(tiny: LoadedModel) -> None:
    (prompt,) = _prompts([10], seed=5)
    free = generate(tiny.model, [prompt], SamplingParams(max_new_tokens=5))
    assert len(free.tokens[0]) == 5 and free.finish_reasons == ["length"]
    assert free.stats.generated_tokens == 5 and len(free.stats.decode_latencies_s) == 4
    eos = free.tokens[0][3]
    first = free.tokens[0].index(eos)
    stopped = generate(tiny.model, [prompt], SamplingParams(max_new_tokens=5), eos_ids={eos})
    assert stopped.tokens[0] == free.tokens[0][:first]
    assert stopped.finish_reasons == ["stop"]
    # The EOS step is a sampled token: counted in the stats, not in the output.
    assert stopped.stats.generated_tokens == first + 1


def test_stop_string_cut_and_streamed(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    prompt = encode_prompt(tok, "Beautiful is better than", chat=False)
    free = generate(tiny.model, [prompt], SamplingParams(max_new_tokens=40), tokenizer=tok)
    text = free.texts[0]
    assert len(text) > 12, text
    stop = text[6:10]
    cut = text.index(stop)
    events: list[StreamEvent] = []
    params = SamplingParams(max_new_tokens=40, stop=(stop, "never-there"))
    got = generate(tiny.model, [prompt], params, tokenizer=tok, on_token=events.append)
    assert got.texts[0] == text[:cut]
    assert got.finish_reasons == ["stop"]
    assert "".join(e.text for e in events) == got.texts[0]
    assert events[-1].finish_reason == "stop" and all(e.finish_reason is None for e in events[:-1])
    # Without a tokenizer there is no text to search.
    with pytest.raises(GenerationError, match="stop strings: expected a tokenizer"):
        generate(tiny.model, [prompt], params)


def test_streamed_text_equals_result_text(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    prompt = encode_prompt(tok, "Explicit is better than implicit.", chat=False)
    events: list[StreamEvent] = []
    params = SamplingParams(max_new_tokens=30)
    got = generate(tiny.model, [prompt], params, tokenizer=tok, on_token=events.append)
    assert "".join(e.text for e in events) == got.texts[0]
    assert got.texts[0] == tok.decode(got.tokens[0], skip_special_tokens=True)
    assert [e.token for e in events] == got.tokens[0]


def test_stats_consistency(tiny: LoadedModel) -> None:
    prompts = _prompts([6, 11], seed=6)
    stats = generate(tiny.model, prompts, SamplingParams(max_new_tokens=12)).stats
    assert stats.generated_tokens == 12 and len(stats.decode_latencies_s) == 11
    assert stats.prompt_tokens == 17 and stats.batch_size == 2
    # TTFT + the steps account for the whole call: only the final timer read lies between.
    assert stats.consistency() < 0.02
    assert stats.decode_tok_s == pytest.approx(2 * 11 / math.fsum(stats.decode_latencies_s))
    assert all(t > 0 for t in stats.decode_latencies_s) and stats.ttft_s > 0


class _Ban:
    """Bans a fixed set of tokens and records what it was shown."""

    def __init__(self, banned: list[int]) -> None:
        self.banned = torch.tensor(banned, dtype=torch.long)
        self.seen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(input_ids.clone())
        out = logits.clone()
        out[:, self.banned] = -math.inf
        return out


def test_banning_processor_is_respected(tiny: LoadedModel) -> None:
    prompts = _prompts([4, 7], seed=7)
    free = generate(tiny.model, prompts, GREEDY)
    banned = sorted({t for row in free.tokens for t in row})
    ban = _Ban(banned)
    got = generate(tiny.model, prompts, GREEDY, processors=[ban])
    assert not set(banned) & {t for row in got.tokens for t in row}
    # Called once per step, on right-aligned rows whose last column is the newest token.
    assert len(ban.seen) == GREEDY.max_new_tokens
    assert ban.seen[0].tolist() == [[-1, -1, -1, *prompts[0]], prompts[1]]
    for step, ids in enumerate(ban.seen[1:]):
        assert ids.shape == (2, 7 + step + 1)
        assert ids[:, -1].tolist() == [got.tokens[0][step], got.tokens[1][step]]


def test_a_finished_row_reads_minus_one_in_the_history(tiny: LoadedModel) -> None:
    """The processors' history: each step's column holds each row's token, the EOS that
    ends a row included, and -1 for that row from the next step on; the others go on."""
    prompts = _prompts([4, 7], seed=7)
    free = generate(tiny.model, prompts, GREEDY)
    eos = next(t for t in free.tokens[0][1:] if t not in free.tokens[1])
    stop = free.tokens[0].index(eos)
    ban = _Ban([])
    got = generate(tiny.model, prompts, GREEDY, processors=[ban], eos_ids=[eos])
    assert got.tokens == [free.tokens[0][:stop], free.tokens[1]]
    for step, ids in enumerate(ban.seen[1:]):
        first = free.tokens[0][step] if step <= stop else -1
        assert ids[:, -1].tolist() == [first, free.tokens[1][step]]


def test_context_window_caps_the_tokens(tiny: LoadedModel) -> None:
    window = tiny.model.config.max_position_embeddings  # 256
    (prompt,) = _prompts([window - 3], seed=8)
    got = generate(tiny.model, [prompt], SamplingParams(max_new_tokens=10))
    assert len(got.tokens[0]) == 3 and got.finish_reasons == ["length"]
    (long,) = _prompts([window], seed=8)
    with pytest.raises(GenerationError, match=rf"expected at most {window - 1} tokens"):
        generate(tiny.model, [long], GREEDY)


def test_bad_prompts(tiny: LoadedModel) -> None:
    with pytest.raises(GenerationError, match="prompt 1: expected at least one token"):
        generate(tiny.model, [[5], []], GREEDY)
    with pytest.raises(GenerationError, match=r"expected token ids in \[0, 512\), got 512"):
        generate(tiny.model, [[5, 512]], GREEDY)
    with pytest.raises(GenerationError, match="expected at least one prompt"):
        generate(tiny.model, [], GREEDY)
    with pytest.raises(GenerationError, match="expected some text"):
        encode_prompt(tiny.tokenizer, "  ")


def test_chat_template_and_eos_ids(tiny: LoadedModel, tiny_model_dir: Path) -> None:
    tok = tiny.tokenizer
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    try:
        ids = encode_prompt(tok, "hello")  # default: chat, since there is a template
        assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
        assert ids[-1] == tok.eos_token_id
        assert encode_prompt(tok, "hello", chat=False) == tok.encode("hello")
    finally:
        tok.chat_template = None
    with pytest.raises(GenerationError, match="expected a tokenizer with a chat template"):
        encode_prompt(tok, "hello", chat=True)
    eos = eos_token_ids(tokenizer=tok, config={"eos_token_id": [2, 7]}, model_dir=tiny_model_dir)
    assert eos == {tok.eos_token_id, 2, 7}


def test_compiled_decode_step_matches_eager(tiny: LoadedModel) -> None:
    (prompt,) = _prompts([9], seed=9)
    eager = generate(tiny.model, [prompt], SamplingParams(max_new_tokens=8))
    compiled = generate(tiny.model, [prompt], SamplingParams(max_new_tokens=8), compile=True)
    assert compiled.tokens == eager.tokens


# --------------------------------------------------------------------------- text streaming


def test_stop_string_stream_holds_back_a_possible_stop() -> None:
    stream = StopStringStream(("END", "xyz"))
    assert stream.feed("Hello E") == "Hello "  # "E" may start "END"
    assert stream.feed("N") == ""
    assert stream.feed("D and more") == ""
    assert stream.text == "Hello " and stream.stopped
    assert stream.feed("ignored") == "" and stream.finish() == ""
    other = StopStringStream(("END",))
    assert other.feed("an EN") + other.feed("TRY") == "an ENTRY"
    assert other.feed(" E") == " " and other.finish() == "E" and not other.stopped
    # A stop string split over several deltas, starting in text already shown as safe.
    split = StopStringStream(("abc",))
    shown = split.feed("xa") + split.feed("b") + split.feed("cd")
    assert shown == "x" and split.text == "x"


def test_incremental_detokenizer_handles_split_characters(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    text = "Zen: héllo wörld ☃ — naïve"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(t) for t in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + detok.flush() == text


# --------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_embedded_model_greedy_matches_transformers(session_home: None) -> None:
    """SmolLM2-135M-Instruct, dense fp32, from the shared cache ($QUANTKIT_HOME as the user has
    it: converting the GGUF again into a temporary home would take longer than the test)."""
    import transformers

    loaded = load_model("smollm2-135m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32)
    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    params = SamplingParams(max_new_tokens=64)
    prompts = (
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis to a child.",
        "List three uses of a paperclip.",
        "Translate 'good morning' into Spanish and German.",
    )
    ids = encode_prompt(loaded.tokenizer, prompts[0])
    with torch.no_grad():  # logits, fp32: the bound is 1e-4 relative
        ours = loaded.model(torch.tensor([ids]))
        theirs = ref.eval()(torch.tensor([ids])).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4
    for text in prompts:
        ids = encode_prompt(loaded.tokenizer, text)
        got = generate(loaded.model, [ids], params, eos_ids=eos, tokenizer=loaded.tokenizer)
        out = ref.eval().generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        want = out[0, len(ids) :].tolist()
        if got.finish_reasons[0] == "stop":  # transformers keeps the EOS in its output
            assert want[-1] in eos
            want = want[:-1]
        assert got.tokens[0] == want, text
        assert got.texts[0] == loaded.tokenizer.decode(want, skip_special_tokens=True)


# --------------------------------------------------------------------------- the lm_head dtype


def test_bf16_head_halves_its_bytes_and_keeps_the_logits(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import quantkit.runtime.head as lm_head
    from quantkit.perf.roofline import model_read_bytes

    model = load_model(tiny_model_dir, tokenizer=False).model
    ids = torch.tensor(_prompts([20], seed=10))
    with torch.inference_mode():
        want = model(ids)
        before = model_read_bytes(model)
        lm_head.set_head_dtype(model, torch.bfloat16)
        got = model(ids)
    assert got.dtype == torch.float32
    # Only the activation is rounded to bf16 (8 bits of mantissa): ~0.4% of the logit scale.
    torch.testing.assert_close(got, want, rtol=0, atol=0.01 * want.abs().max().item())
    assert not torch.equal(got, want)
    after = model_read_bytes(model)
    assert after.head == before.head // 2 and not after.tied
    assert after.embedding == before.embedding  # the table stays fp32 for the embedding lookup
    with pytest.raises(GenerationError, match="head dtype: expected one of"):
        lm_head.set_head_dtype(model, torch.int16)
    # auto, for a quantized fp32 model only: int8 where measured faster (Intel with the int8
    # GEMV), else bf16 on a CPU with bf16 instructions, else fp32.
    monkeypatch.setattr(lm_head, "int8_head_faster", lambda: True)
    assert lm_head.auto_head_dtype(model, quantized=True) == torch.int8
    assert lm_head.auto_head_dtype(model, quantized=False) == torch.float32
    monkeypatch.setattr(lm_head, "int8_head_faster", lambda: False)
    monkeypatch.setattr(lm_head, "has_bf16_dot", lambda: True)
    assert lm_head.auto_head_dtype(model, quantized=True) == torch.bfloat16
    assert lm_head.auto_head_dtype(model, quantized=False) == torch.float32
    monkeypatch.setattr(lm_head, "has_bf16_dot", lambda: False)
    assert lm_head.auto_head_dtype(model, quantized=True) == torch.float32

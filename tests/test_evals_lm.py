"""`QuantkitLM` against lm-eval's own transformers backend (HFLM) and the perplexity function.

HFLM runs the transformers model on the same directory, so equal log-likelihoods mean equal
tokenization (context/continuation split, empty contexts, BOS) and equal numerics. The tiny
model of tests/conftest.py runs in milliseconds; the embedded SmolLM2 case is marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from quantkit.errors import EvalError  # noqa: E402
from quantkit.evals.accuracy.perplexity import perplexity  # noqa: E402

ZEN = [
    "Beautiful is better than ugly.",
    "Explicit is better than implicit.",
    "Simple is better than complex.",
    "Complex is better than complicated.",
    "Flat is better than nested.",
    "Sparse is better than dense.",
    "Readability counts.",
    "Errors should never pass silently.",
]


@pytest.fixture(autouse=True)
def _env(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    one_thread: None,
) -> None:
    # The slow test deliberately uses the user's cache, where the embedded model is converted
    # already (converting it again into a temporary home takes minutes).
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _requests() -> list[Instance]:
    """20 pairs: shared contexts (multiple choice), one- and many-token continuations, an
    empty context, a trailing space in the context, and one long context."""
    pairs = []
    for i, line in enumerate(ZEN[:5]):
        head, _, tail = line.partition(" is ")
        pairs += [(f"{head} is", f" {tail}"), (f"{head} is", " worse."), (f"{head} is", " bad")]
        if i == 0:
            pairs.append((f"{head} is ", tail))
    pairs += [("", ZEN[6]), ("", "Now"), ("Readability", " counts.")]
    pairs.append((" ".join(ZEN * 3), " Special cases aren't special enough."))
    assert len(pairs) == 20
    return [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]


@pytest.fixture(scope="module")
def hflm(tiny_model_dir: Path):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny_model_dir), batch_size=4, dtype="float32", device="cpu")


def _qlm(path: Path, **kwargs):
    from quantkit.evals.accuracy.lm_eval_model import QuantkitLM

    return QuantkitLM(pretrained=str(path), progress=False, **kwargs)


@pytest.mark.parametrize(
    "options",
    [{}, {"batch_size": 1, "max_batch_tokens": 16}, {"batch_size": 3, "max_batch_tokens": 64}],
    ids=["one-batch", "tiny-batches", "mixed"],
)
def test_loglikelihood_matches_transformers(hflm, tiny_model_dir: Path, options: dict) -> None:
    reqs = _requests()
    want = hflm.loglikelihood(reqs, disable_tqdm=True)
    got = _qlm(tiny_model_dir, **options).loglikelihood(reqs, disable_tqdm=True)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want, strict=True):
        assert lp == pytest.approx(ref_lp, abs=1e-3)
        assert greedy == ref_greedy
    # The pairs differ, so the numbers must too (a constant would pass a loose check).
    assert len({round(lp, 3) for lp, _ in got}) > 15


def test_loglikelihood_truncates_like_hflm(tiny_model_dir: Path) -> None:
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(tiny_model_dir), batch_size=2, max_length=24, device="cpu")
    reqs = _requests()[-4:]
    want = hf.loglikelihood(reqs, disable_tqdm=True)
    got = _qlm(tiny_model_dir, max_length=24).loglikelihood(reqs, disable_tqdm=True)
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-3)


def test_rolling_matches_perplexity_and_transformers(hflm, tiny_model_dir: Path) -> None:
    lm = _qlm(tiny_model_dir, max_length=32)
    text = " ".join(ZEN * 2)
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    tokens = torch.tensor([lm.prefix_token_id, *lm.tok_encode(text, add_special_tokens=False)])
    assert tokens.numel() > 3 * 32  # several windows
    ppl = perplexity(lm.model, tokens, window=32, stride=31)
    assert ppl.tokens == tokens.numel() - 1  # every token after the prefix scored once
    assert got == pytest.approx(-ppl.nll * ppl.tokens, rel=1e-5)
    # One window: HFLM computes the same thing.
    short = Instance("loglikelihood_rolling", {}, (ZEN[0] + " " + ZEN[1],), 0)
    (want,) = hflm.loglikelihood_rolling([short], disable_tqdm=True)
    (got,) = _qlm(tiny_model_dir).loglikelihood_rolling([short])
    assert got == pytest.approx(want, abs=1e-3)


def test_generate_until_matches_transformers_greedy(hflm, tiny_model_dir: Path) -> None:
    reqs = [
        Instance("generate_until", {}, (ctx, {"until": ["."], "max_gen_toks": 12}), i)
        for i, ctx in enumerate(["Beautiful is", "Errors should never", "Flat"])
    ]
    want = hflm.generate_until(reqs, disable_tqdm=True)
    got = _qlm(tiny_model_dir).generate_until(reqs, disable_tqdm=True)
    assert got == want
    assert all("." not in text for text in got)


def test_add_bos_token(tiny_model_dir: Path) -> None:
    bos = _qlm(tiny_model_dir).tokenizer.bos_token_id
    assert _qlm(tiny_model_dir).tok_encode("Readability counts.")[0] != bos
    with_bos = _qlm(tiny_model_dir, add_bos_token=True)
    ids = with_bos.tok_encode("Readability counts.")
    assert ids[0] == bos and ids[1:] == _qlm(tiny_model_dir).tok_encode("Readability counts.")
    # A prompt that already starts with BOS (a chat template's) gets no second one.
    assert with_bos.tok_encode(with_bos.tokenizer.bos_token + "Hi")[1] != bos
    # And the BOS changes the scores (the model sees a different first token).
    req = [Instance("loglikelihood", {}, ("Readability", " counts."), 0)]
    plain = _qlm(tiny_model_dir).loglikelihood(req, disable_tqdm=True)[0][0]
    assert with_bos.loglikelihood(req, disable_tqdm=True)[0][0] != pytest.approx(plain, abs=1e-4)


def test_plan_batches_respects_both_budgets() -> None:
    from quantkit.evals.accuracy.continuations import plan_batches

    g = torch.Generator().manual_seed(0)
    groups = [
        (
            int(torch.randint(1, 60, (), generator=g)),
            torch.randint(1, 9, (4,), generator=g).tolist(),
        )
        for _ in range(200)
    ]
    groups.append((500, [3, 3]))  # bigger than the budget alone: a batch of its own
    plan = plan_batches(groups, batch_size=8, max_tokens=256)
    assert [i for batch in plan for i in batch] == list(range(len(groups)))  # order kept
    assert plan[-1] == [200]
    for batch in plan[:-1]:
        ctx = max(groups[i][0] for i in batch)
        conts = [n for i in batch for n in groups[i][1]]
        assert len(batch) <= 8 and len(batch) * ctx <= 256 and len(conts) * max(conts) <= 256
    assert len(plan) < len(groups) / 2  # it does batch


def test_registered_with_lm_eval_and_keeps_builtin_models() -> None:
    from lm_eval.api.registry import get_model

    import quantkit.evals  # noqa: F401
    from quantkit.evals.accuracy.lm_eval_model import QuantkitLM

    assert get_model("quantkit") is QuantkitLM
    assert get_model("hf").__name__ == "HFLM"


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"dtype": "int3"}, "dtype: expected one of float32"),
        ({"batch_size": "many"}, "batch_size: expected an integer >= 1, got 'many'"),
        ({"add_bos_token": "maybe"}, "add_bos_token: expected true or false"),
        ({"max_length": 100000}, "max_length: expected at most the model's context window"),
    ],
)
def test_bad_model_args(tiny_model_dir: Path, options: dict, needle: str) -> None:
    with pytest.raises(EvalError, match=needle):
        _qlm(tiny_model_dir, **options)


@pytest.mark.slow
def test_embedded_model_matches_transformers() -> None:
    """The dense embedded SmolLM2-135M: 20 real ARC-Easy-style requests, HFLM vs QuantkitLM."""
    from lm_eval.models.huggingface import HFLM

    from quantkit.sources.resolve import resolve_model

    path = resolve_model("smollm2-135m", progress=False)  # the shared cache, see _env
    ctx = [
        "Question: Which gas do plants take in for photosynthesis?\nAnswer:",
        "Question: What is the boiling point of water at sea level?\nAnswer:",
        "Question: Which organ pumps blood through the body?\nAnswer:",
        "Question: What force pulls objects toward Earth?\nAnswer:",
        "The capital of France is",
    ]
    answers = [" carbon dioxide", " oxygen", " 100 degrees Celsius", " the heart"]
    reqs = [
        Instance("loglikelihood", {}, (c, a), i * 4 + j)
        for i, c in enumerate(ctx)
        for j, a in enumerate(answers)
    ]
    hf = HFLM(pretrained=str(path), batch_size=8, dtype="float32", device="cpu")
    want = hf.loglikelihood(reqs, disable_tqdm=True)
    got = _qlm(path).loglikelihood(reqs, disable_tqdm=True)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want, strict=True):
        assert lp == pytest.approx(ref_lp, abs=1e-3)
        assert greedy == ref_greedy

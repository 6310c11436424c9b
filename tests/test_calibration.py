"""Calibration text: the Wikipedia split, user files, token windows (hand-made tokenizer and
dump), and the real gensim dump with the embedded tokenizer (slow, shared cache)."""

from __future__ import annotations

import bz2
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from quantkit.errors import CalibrationError
from quantkit.quantize import calibration
from quantkit.quantize.calibration import (
    WikiSplit,
    calibration_samples,
    heldout_tokens,
    parse_wiki_dump,
    read_calib_file,
    split_articles,
    tokenize_documents,
    wiki_articles,
    wiki_split,
)

N_WORDS = 5000
EOS = N_WORDS  # id of "<eos>" in the tiny tokenizer


@pytest.fixture(scope="module")
def word_tokenizer():
    """Whitespace word-level tokenizer: "w17" -> 17, "<eos>" -> 5000, anything else -> <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(N_WORDS)}
    vocab.update({"<eos>": EOS, "<unk>": EOS + 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


# --------------------------------------------------------------------------- tokens and windows


def test_tokenize_documents_puts_eos_between_documents(word_tokenizer) -> None:
    got = tokenize_documents(["w1 w2", "w3", "w4 w5"], word_tokenizer)
    assert got.dtype == torch.int64
    assert got.tolist() == [1, 2, EOS, 3, EOS, 4, 5]
    assert tokenize_documents([], word_tokenizer).numel() == 0


def _window_starts(stream: torch.Tensor, samples: torch.Tensor) -> list[int]:
    """Where each sample sits in the token stream (it must be a contiguous slice)."""
    windows = stream.unfold(0, samples.shape[1], 1)
    starts = []
    for row in samples:
        hits = (windows == row).all(dim=1).nonzero().flatten()
        assert hits.numel() == 1, "sample is not one contiguous slice of the text"
        starts.append(int(hits[0]))
    return starts


def test_samples_shape_determinism_and_no_overlap(word_tokenizer) -> None:
    docs = [words(k * 500, 480) for k in range(10)]  # 4,809 tokens, every id unique but EOS
    stream = tokenize_documents(docs, word_tokenizer)
    a = calibration_samples(docs, word_tokenizer, n_samples=8, seq_len=64, seed=0)
    assert a.shape == (8, 64) and a.dtype == torch.int64
    assert torch.equal(
        a, calibration_samples(docs, word_tokenizer, n_samples=8, seq_len=64, seed=0)
    )
    b = calibration_samples(docs, word_tokenizer, n_samples=8, seq_len=64, seed=1)
    assert not torch.equal(a, b)
    for samples in (a, b):
        starts = sorted(_window_starts(stream, samples))
        assert all(s2 - s1 >= 64 for s1, s2 in zip(starts, starts[1:], strict=False))
    # Not a fixed grid: placements differ between seeds and are not all aligned to seq_len.
    assert sorted(_window_starts(stream, a)) != sorted(_window_starts(stream, b))
    assert any(s % 64 for s in _window_starts(stream, a) + _window_starts(stream, b))


def test_samples_fill_the_text_exactly_when_it_just_fits(word_tokenizer) -> None:
    docs = [words(0, 40)]  # 40 tokens, 4 windows of 10: the only placement is the tiling
    samples = calibration_samples(docs, word_tokenizer, n_samples=4, seq_len=10, seed=3)
    assert sorted(samples[:, 0].tolist()) == [0, 10, 20, 30]


def test_short_text_overlaps_with_a_warning(word_tokenizer) -> None:
    docs = [words(0, 50)]
    with pytest.warns(UserWarning, match="50 tokens, fewer than n_samples x seq_len = 80"):
        samples = calibration_samples(docs, word_tokenizer, n_samples=4, seq_len=20, seed=0)
    assert samples.shape == (4, 20)
    starts = _window_starts(tokenize_documents(docs, word_tokenizer), samples)
    assert min(starts) == 0 and max(starts) == 30  # spread over the whole text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough text: no warning
        calibration_samples(docs, word_tokenizer, n_samples=2, seq_len=20, seed=0)


def test_too_little_text_for_one_window(word_tokenizer) -> None:
    with pytest.raises(CalibrationError, match=r"found 5 tokens, need at least seq_len=16"):
        calibration_samples([words(0, 5)], word_tokenizer, n_samples=2, seq_len=16, seed=0)
    with pytest.raises(CalibrationError, match="expected >= 1"):
        calibration_samples([words(0, 50)], word_tokenizer, n_samples=0, seq_len=16, seed=0)


# --------------------------------------------------------------------------- user files


def test_read_txt_splits_on_blank_lines(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text("First doc line one.\nline two.\n\n  \n\nSecond doc.\n\n\nThird.\n")
    assert read_calib_file(f) == ["First doc line one.\nline two.", "Second doc.", "Third."]


def test_read_jsonl_takes_the_text_field(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    lines = [{"text": "Alpha beta.", "id": 1}, {"text": "Gamma\n\ndelta."}]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert read_calib_file(str(f)) == ["Alpha beta.", "Gamma\n\ndelta."]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.txt", None, "does not exist"),
        ("c.csv", "a,b\n", "expected a .txt or .jsonl file, got .csv"),
        ("c.txt", "", "is empty"),
        ("c.txt", " \n\n \n", "is empty"),
        ("c.jsonl", '{"text": "ok"}\n{"text": \n', "line 2: expected a JSON object"),
        ("c.jsonl", '{"text": "ok"}\n{"body": "x"}\n', 'line 2: expected a "text" field'),
        ("c.jsonl", '["text"]\n', 'line 1: expected a "text" field, got list'),
        ("c.jsonl", '{"text": 3}\n', 'line 1: expected "text" to be a string'),
        ("c.jsonl", "\n\n", "is empty"),
    ],
)
def test_calib_file_errors(tmp_path: Path, name: str, content: str | None, message: str) -> None:
    f = tmp_path / name
    if content is not None:
        f.write_text(content)
    with pytest.raises(CalibrationError, match=message):
        read_calib_file(f)


# --------------------------------------------------------------------------- Wikipedia


def test_split_is_deterministic_and_disjoint() -> None:
    articles = [f"article {i}" for i in range(23)]
    split = split_articles(articles)
    assert split == split_articles(list(articles))
    assert split.heldout == [f"article {i}" for i in (4, 9, 14, 19)]
    assert not set(split.heldout) & set(split.calibration)
    assert sorted(split.heldout + split.calibration) == sorted(articles)
    assert isinstance(split, WikiSplit)


PROSE = "The river flows north through the valley and reaches the sea after many miles."


def _page(title: str, ns: int, text: str, redirect: bool = False) -> str:
    red = f'<redirect title="{title}x" />' if redirect else ""
    return (
        f"<page><title>{title}</title><ns>{ns}</ns><id>1</id>{red}"
        f'<revision><id>2</id><text xml:space="preserve">{text}</text></revision></page>'
    )


@pytest.fixture
def tiny_dump(tmp_path: Path) -> Path:
    wikitext = (
        "{{Infobox river|name=Foo}}\n'''Foo''' is a [[river]] in [[Bar|Barland]]."
        "&lt;ref&gt;Smith, J. ''Rivers''. 1999. p. 3.&lt;/ref&gt; "
        + PROSE
        + "\n\n== History ==\n[[File:Foo.jpg|thumb|A view of the river from the hill above.]]\n"
        '{| class="wikitable"\n|-\n| cell one of the table with many words in it here.\n|}\n'
        + PROSE.replace("river", "canal")
        + "\n* short list item\n[[Category:Rivers of Barland]]\n"
        "== References ==\n" + PROSE.replace("river", "reference") + "\n"
    )
    pages = [
        _page("Foo", 0, wikitext),
        _page("Redirected", 0, "#REDIRECT [[Foo]]", redirect=True),
        _page("Wikipedia:About", 4, PROSE),
        _page("Stub", 0, "{{stub}}"),
    ] + [_page(f"A{i}", 0, PROSE.replace("river", f"stream{i}")) for i in range(9)]
    xml = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/"><siteinfo/>'
        + "".join(pages)
        + "</mediawiki>"
    )
    path = tmp_path / "tiny-wiki.xml.bz2"
    path.write_bytes(bz2.compress(xml.encode()))
    return path


def test_parse_wiki_dump_keeps_prose_only(tiny_dump: Path) -> None:
    articles = parse_wiki_dump(tiny_dump)
    # Redirect, non-article namespace and the article left empty after cleaning are skipped.
    assert len(articles) == 10
    foo = articles[0]
    assert foo.startswith("Foo is a river in Barland.")
    assert PROSE in foo and PROSE.replace("river", "canal") in foo
    for junk in (
        "Smith",
        "Infobox",
        "thumb",
        "view of the river",
        "cell one",
        "Category",
        "short list item",
        "History",
        "reference",
        "{{",
        "[[",
        "|",
    ):
        assert junk not in foo, junk
    # Paragraphs separated by blank lines; the reference removed without a stray space.
    assert foo.split("\n\n") == [
        f"Foo is a river in Barland. {PROSE}",
        PROSE.replace("river", "canal"),
    ]
    assert articles[1] == PROSE.replace("river", "stream0")


def test_wiki_articles_are_cached(tiny_dump: Path, tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    first = wiki_articles(source=tiny_dump, home=home)
    (cached,) = (home / "calibration").iterdir()
    assert json.loads(cached.read_text())["articles"] == first

    def no_reparse(path):
        raise AssertionError("parsed twice")

    monkeypatch.setattr(calibration, "parse_wiki_dump", no_reparse)
    assert wiki_articles(source=tiny_dump, home=home) == first
    split = wiki_split(source=tiny_dump, home=home)
    assert split.heldout == [first[4], first[9]] and len(split.calibration) == 8


def test_heldout_tokens(tiny_dump: Path, tmp_path: Path, word_tokenizer) -> None:
    # The word tokenizer maps prose to <unk>; count tokens, the content is tested above.
    split = wiki_split(source=tiny_dump, home=tmp_path)
    full = heldout_tokens(word_tokenizer, max_tokens=None, source=tiny_dump, home=tmp_path)
    assert torch.equal(full, tokenize_documents(split.heldout, word_tokenizer))
    short = heldout_tokens(word_tokenizer, max_tokens=7, source=tiny_dump, home=tmp_path)
    assert torch.equal(short, full[:7])
    with pytest.raises(CalibrationError, match="max_tokens"):
        heldout_tokens(word_tokenizer, max_tokens=0, source=tiny_dump, home=tmp_path)


def test_missing_gensim_says_how_to_install(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "gensim" else real(n, *a)
    )
    with pytest.raises(CalibrationError, match="pip install --no-deps gensim"):
        wiki_split()


# --------------------------------------------------------------------------- the real text


@pytest.mark.slow
def test_real_wikipedia_split_with_the_embedded_tokenizer() -> None:
    from quantkit.sources.resolve import DEFAULT_MODEL, resolve_model
    from quantkit.sources.tokenizer import load_tokenizer

    # Deliberately the shared cache (parsed articles and the converted model).
    home_env = os.environ.get("QUANTKIT_HOME")
    home = Path(home_env).expanduser() if home_env else None
    split = wiki_split(home=home)
    assert len(split.calibration) == 84 and len(split.heldout) == 21
    assert not set(split.calibration) & set(split.heldout)
    assert split.calibration[0].startswith("Anarchism is a political philosophy")
    tok = load_tokenizer(resolve_model(DEFAULT_MODEL, home=home, progress=False))
    held = heldout_tokens(tok, max_tokens=None, home=home)
    assert held.numel() >= 32_000  # measured 95,463
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 475k calibration tokens: 128 x 512 never overlap
        samples = calibration_samples(split.calibration, tok, n_samples=128, seq_len=512, seed=0)
    assert samples.shape == (128, 512)
    text = tok.decode(samples[0], skip_special_tokens=True)
    assert sum(c.isalpha() for c in text) > 0.6 * len(text)  # prose, not markup


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("truncated", "unreadable JSON"),
        ("emptied", "unreadable JSON"),
        ("not-an-object", "expected an object"),
        ("an-article-changed", "SHA-256 differs"),
    ],
)
def test_a_damaged_calibration_cache_is_parsed_again_with_one_warning(
    tiny_dump: Path, tmp_path: Path, damage: str, why: str
) -> None:
    home = tmp_path / "home"
    first = wiki_articles(source=tiny_dump, home=home)
    (cached,) = (home / "calibration").iterdir()
    whole = cached.read_text()
    spoiled = {
        "truncated": whole[: len(whole) // 2],
        "emptied": "",
        "not-an-object": "[1, 2]",
        "an-article-changed": whole.replace("river", "rivet", 1),
    }[damage]
    assert spoiled != whole
    cached.write_text(spoiled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = wiki_articles(source=tiny_dump, home=home)
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and why in lines[0] and "parsing again" in lines[0], lines
    assert again == first and cached.read_text() == whole  # rebuilt whole

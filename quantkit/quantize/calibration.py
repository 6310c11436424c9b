"""Real text for calibration, and a held-out split of it for evaluation.

The default text is the sample of English Wikipedia that the gensim wheel ships for its own tests
(106 articles, "Anarchism" to "Arabic", 6 MB of wikitext; install it with `pip install --no-deps
gensim`). It is found with `find_spec`, never imported: gensim's own imports are heavy and its
dependencies are not needed. Parsing the dump and stripping the markup takes seconds, so the
cleaned articles are cached as JSON under $QUANTKIT_HOME, keyed by the dump's content hash.

Articles are split by their order in the dump: every fifth (i % 5 == 4) is held out for
perplexity, the rest calibrate. A user's own text comes from a .txt or .jsonl file instead
(`read_calib_file`). Calibration samples are fixed-length token windows drawn from the documents
concatenated with EOS between them, never random tokens.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import CalibrationError
from quantkit.paths import atomic_file, quantkit_home

__all__ = [
    "HELDOUT_EVERY",
    "WIKI_FILE",
    "WikiSplit",
    "calibration_samples",
    "clean_wikitext",
    "heldout_tokens",
    "parse_wiki_dump",
    "read_calib_file",
    "split_articles",
    "tokenize_documents",
    "wiki_articles",
    "wiki_source_path",
    "wiki_split",
]

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# Article i is held out iff i % HELDOUT_EVERY == HELDOUT_EVERY - 1 (one in five).
HELDOUT_EVERY = 5
# Bump when the cleaning changes, so cached articles are parsed again.
_PARSER_VERSION = 1
# The cache file's layout: 2 added the articles' SHA-256 (a damaged entry is told from a whole one).
_CACHE_FORMAT = 2
# A kept line needs this many words and a sentence end: headings, list stubs, captions and
# table remnants fail one or the other, prose paragraphs pass.
_MIN_WORDS = 8
_SENTENCE_END = tuple(".!?\"')")
# Sections after which an article holds lists of citations and links, not prose.
_TAIL_SECTION = re.compile(
    r"^={2,}\s*(see also|references|notes|external links|further reading|bibliography|"
    r"sources|footnotes|citations)\s*={2,}\s*$",
    re.MULTILINE | re.IGNORECASE,
)
# Tags whose content is not prose (footnotes, tables, formulas, code, galleries).
_DROP_TAGS = frozenset(
    "ref table gallery math timeline score syntaxhighlight source pre imagemap chem code".split()
)
# Links that strip_code would turn into captions or stray words: files, categories, interwiki.
_DROP_LINK = re.compile(r"^\s*:?\s*(file|image|category|media|[a-z]{2,3}(-[a-z]+)?)\s*:", re.I)
# Parentheses emptied by removed pronunciation/convert templates: "Asphalt (, , occasionally )".
_EMPTY_PARENS = re.compile(r"\s*\((?:[\s,;]|occasionally|or|also)*\)")


@dataclass(frozen=True)
class WikiSplit:
    """Articles for calibration and the held-out ones for evaluation (disjoint)."""

    calibration: list[str]
    heldout: list[str]


# --------------------------------------------------------------------------- Wikipedia


def wiki_source_path() -> Path:
    """The Wikipedia dump inside the installed gensim wheel (gensim is not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / "test" / "test_data" / WIKI_FILE
        if path.is_file():
            return path
    raise CalibrationError(
        "the default calibration text is the Wikipedia sample in the gensim wheel, which is "
        "not installed (or lacks it); install it with: pip install --no-deps gensim, or pass "
        "your own .txt/.jsonl calibration file"
    )


def clean_wikitext(wikitext: str) -> str:
    """Prose paragraphs of one article's wikitext, separated by blank lines."""
    import mwparserfromhell

    tail = _TAIL_SECTION.search(wikitext)
    if tail:
        wikitext = wikitext[: tail.start()]
    code = mwparserfromhell.parse(wikitext)
    junk = code.filter_tags(matches=lambda n: str(n.tag).strip().lower() in _DROP_TAGS)
    junk += code.filter_wikilinks(matches=lambda n: bool(_DROP_LINK.match(str(n.title))))
    for node in junk:
        try:
            code.remove(node)
        except ValueError:  # already gone with a removed parent
            pass
    paragraphs = []
    for line in code.strip_code(normalize=True, collapse=True).splitlines():
        line = re.sub(r"\s{2,}", " ", _EMPTY_PARENS.sub("", line)).strip()
        line = line.replace(" ,", ",").replace(" .", ".")
        if len(line.split()) >= _MIN_WORDS and line.endswith(_SENTENCE_END):
            paragraphs.append(line)
    return "\n\n".join(paragraphs)


def parse_wiki_dump(path: Path) -> list[str]:
    """The cleaned, non-empty articles (namespace 0, not redirects) of a .xml.bz2 dump, in order."""
    import xml.etree.ElementTree as ET

    def local(tag: str) -> str:
        return tag.rsplit("}", 1)[-1]  # drop the export schema's XML namespace

    articles = []
    with bz2.open(path, "rb") as fh:
        for _, elem in ET.iterparse(fh, events=("end",)):
            if local(elem.tag) != "page":
                continue
            fields = {local(child.tag): child for child in elem}
            ns = fields["ns"].text if "ns" in fields else "0"
            revision = fields.get("revision")
            text_elem = None
            if revision is not None:
                text_elem = next((c for c in revision if local(c.tag) == "text"), None)
            wikitext = (text_elem.text if text_elem is not None else None) or ""
            elem.clear()  # the dump can be large; keep one page in memory
            if (
                ns != "0"
                or "redirect" in fields
                or wikitext.lstrip().lower().startswith("#redirect")
            ):
                continue
            text = clean_wikitext(wikitext)
            if text:
                articles.append(text)
    return articles


def _digest(articles: list[str]) -> str:
    return hashlib.sha256(json.dumps(articles).encode()).hexdigest()


def _read_cached_articles(cache: Path) -> tuple[list[str], str | None]:
    """The cached articles, and why the entry is damaged (None: it is whole)."""
    try:
        payload = json.loads(cache.read_text(encoding="utf-8"))
        articles, digest = payload["articles"], payload["articles_sha256"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [], f"unreadable JSON ({type(e).__name__})"
    except (KeyError, TypeError):
        return [], "expected an object with articles and their SHA-256"
    if not isinstance(articles, list) or not all(isinstance(a, str) for a in articles):
        return [], "expected the articles as a list of texts"
    if _digest(articles) != digest:
        return [], "the articles' SHA-256 differs from the one recorded"
    return articles, None


def wiki_articles(*, source: Path | None = None, home: Path | None = None) -> list[str]:
    """The cleaned articles of `source` (default: gensim's dump), parsed once and cached."""
    source = Path(source) if source is not None else wiki_source_path()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    name = f"{source.name}.{digest}.v{_PARSER_VERSION}.f{_CACHE_FORMAT}.json"
    cache = quantkit_home(home) / "calibration" / name
    if cache.is_file():
        articles, damage = _read_cached_articles(cache)
        if damage is None:
            return articles
        warnings.warn(f"calibration cache {cache}: damaged ({damage}); parsing again", stacklevel=2)
    articles = parse_wiki_dump(source)
    cache.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "source": source.name,
        "parser_version": _PARSER_VERSION,
        "articles_sha256": _digest(articles),
        "articles": articles,
    }
    # Atomic: a reader never sees half a file, and concurrent writers each replace it whole.
    with atomic_file(cache) as tmp:
        tmp.write_text(json.dumps(payload))
    return articles


def split_articles(articles: Sequence[str]) -> WikiSplit:
    """Article i to heldout iff i % 5 == 4, else to calibration."""
    last = HELDOUT_EVERY - 1
    return WikiSplit(
        calibration=[a for i, a in enumerate(articles) if i % HELDOUT_EVERY != last],
        heldout=[a for i, a in enumerate(articles) if i % HELDOUT_EVERY == last],
    )


def wiki_split(*, source: Path | None = None, home: Path | None = None) -> WikiSplit:
    """The default text, split deterministically into calibration and held-out articles."""
    return split_articles(wiki_articles(source=source, home=home))


# --------------------------------------------------------------------------- user files


def read_calib_file(path: Path | str) -> list[str]:
    """Documents of a .txt (separated by blank lines) or .jsonl ("text" per line) file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise CalibrationError(
            f"calibration file {path}: expected a .txt or .jsonl file, got {suffix or 'no'} "
            f"extension"
        )
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"calibration file {path}: expected UTF-8 text ({e})") from e
    if suffix == ".txt":
        docs = [d.strip() for d in re.split(r"\n\s*\n", content)]
    else:
        docs = [_jsonl_text(path, n, line) for n, line in enumerate(content.splitlines(), 1)]
    docs = [d for d in docs if d and d.strip()]
    if not docs:
        raise CalibrationError(f"calibration file {path} is empty; expected text")
    return docs


def _jsonl_text(path: Path, lineno: int, line: str) -> str:
    if not line.strip():
        return ""
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as e:
        raise CalibrationError(
            f"calibration file {path} line {lineno}: expected a JSON object, got invalid JSON "
            f"({e.msg})"
        ) from e
    if not isinstance(record, dict) or "text" not in record:
        got = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
        raise CalibrationError(
            f'calibration file {path} line {lineno}: expected a "text" field, got {got}'
        )
    if not isinstance(record["text"], str):
        raise CalibrationError(
            f'calibration file {path} line {lineno}: expected "text" to be a string, got '
            f"{type(record['text']).__name__}"
        )
    return record["text"]


# --------------------------------------------------------------------------- tokens


def tokenize_documents(texts: Sequence[str], tokenizer: Any) -> torch.Tensor:
    """int64 [T]: every document tokenized without special tokens, EOS between documents.

    EOS marks the boundary the model was trained to see between unrelated texts; a tokenizer
    without one gets the documents back to back.
    """
    if not texts:
        return torch.zeros(0, dtype=torch.int64)
    # One batched call: fast tokenizers encode the batch in parallel. verbose=False silences the
    # "longer than model_max_length" warning: documents are windowed afterwards, never fed whole.
    ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    flat: list[int] = []
    for i, doc in enumerate(ids):
        if i and eos is not None:
            flat.append(eos)
        flat.extend(doc)
    return torch.tensor(flat, dtype=torch.int64)


def calibration_samples(
    texts: Sequence[str], tokenizer: Any, *, n_samples: int, seq_len: int, seed: int
) -> torch.Tensor:
    """int64 [n_samples, seq_len] token windows from `texts`, placed by a generator seeded `seed`.

    With enough text the windows never overlap: their placement is uniform over all
    non-overlapping placements. With fewer than n_samples x seq_len tokens they are spread
    evenly and overlap (a warning says so); with fewer than seq_len tokens it is an error.
    """
    if n_samples < 1 or seq_len < 1:
        raise CalibrationError(
            f"n_samples and seq_len: expected >= 1, got n_samples={n_samples}, seq_len={seq_len}"
        )
    tokens = tokenize_documents(texts, tokenizer)
    total, needed = tokens.numel(), n_samples * seq_len
    if total < seq_len:
        raise CalibrationError(
            f"calibration text too short: found {total} tokens, need at least seq_len={seq_len} "
            f"for one sample ({needed} for {n_samples} samples without overlap)"
        )
    g = torch.Generator().manual_seed(seed)
    if total >= needed:
        # Stars and bars: n sorted distinct points q in [0, slack + n) map one to one onto
        # non-overlapping starts s_i = q_i + i * (seq_len - 1), all of them inside the text.
        slack = total - needed
        q = torch.randperm(slack + n_samples, generator=g)[:n_samples].sort().values
        starts = q + torch.arange(n_samples) * (seq_len - 1)
    else:
        warnings.warn(
            f"calibration text has {total} tokens, fewer than n_samples x seq_len = {needed}; "
            f"the {n_samples} samples overlap",
            stacklevel=2,
        )
        starts = torch.linspace(0, total - seq_len, n_samples).round().long()
    # Shuffle the order too, so a caller taking the first k samples gets a spread of the text.
    starts = starts[torch.randperm(n_samples, generator=g)]
    return tokens[starts[:, None] + torch.arange(seq_len)]


def heldout_tokens(
    tokenizer: Any,
    *,
    max_tokens: int | None,
    source: Path | None = None,
    home: Path | None = None,
) -> torch.Tensor:
    """int64 [T]: the held-out articles tokenized and concatenated (EOS between), <= max_tokens."""
    if max_tokens is not None and max_tokens < 1:
        raise CalibrationError(f"max_tokens: expected >= 1 or None, got {max_tokens}")
    tokens = tokenize_documents(wiki_split(source=source, home=home).heldout, tokenizer)
    return tokens if max_tokens is None else tokens[:max_tokens]

"""A Hugging Face tokenizer.json as llama.cpp's tokenizer metadata (byte-level BPE models).

llama.cpp tokenizes with its own code: the vocabulary in id order, each token's type, the
merges, the special ids, and `tokenizer.ggml.pre`, the name of the pre-tokenizer (the regex
that splits text before BPE). A GGUF with the wrong pre-tokenizer loads and runs but splits
numbers or punctuation differently from the model's own tokenizer, so the name is read from
tokenizer.json's `pre_tokenizer` by its structure and regex, and anything not recognised is an
error naming `--pre-tokenizer` rather than a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import ExportError

# llama.cpp's token types (llama_token_type).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# The Split regexes of the byte-level BPE families, as their tokenizer.json writes them.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEXES = {_LLAMA3: "llama-bpe", _QWEN2: "qwen2"}


@dataclass
class GgufVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    special: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad -> id
    add_bos: bool = False
    chat_template: str | None = None


def _byte_level(node: dict[str, Any]) -> bool:
    return node.get("type") == "ByteLevel"


def pre_tokenizer_name(pre: dict[str, Any] | None) -> str | None:
    """llama.cpp's name for a tokenizer.json `pre_tokenizer`, or None when not recognised."""
    if pre is None:
        return None
    if _byte_level(pre) and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers", [])
    if len(steps) != 2 or not _byte_level(steps[1]):
        return None
    first, last = steps
    if first.get("type") == "Digits" and first.get("individual_digits") and last.get("use_regex"):
        return "smollm"
    if first.get("type") == "Split" and not last.get("use_regex", True):
        return SPLIT_REGEXES.get(first.get("pattern", {}).get("Regex", ""))
    return None


def _merges(model: dict[str, Any]) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def read_vocab(
    model_dir: Path, config: dict[str, Any], *, pre_tokenizer: str | None = None
) -> GgufVocab:
    """The GGUF tokenizer of the HF directory `model_dir` (tokenizer.json + the config's ids)."""
    file = Path(model_dir) / "tokenizer.json"
    if not file.is_file():
        raise ExportError(
            f"{model_dir}: expected tokenizer.json for the GGUF tokenizer, found none"
        )
    spec = json.loads(file.read_text())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or not _byte_level(spec.get("decoder") or {}):
        raise ExportError(
            f"{file.name}: expected a byte-level BPE tokenizer (GPT-2 style; llama.cpp's gpt2 "
            f"model), got model {model.get('type')!r} with decoder "
            f"{(spec.get('decoder') or {}).get('type')!r}"
        )
    pre = pre_tokenizer or pre_tokenizer_name(spec.get("pre_tokenizer"))
    if pre is None:
        got = json.dumps(spec.get("pre_tokenizer"))[:120]
        raise ExportError(
            f"{file.name}: expected a pre-tokenizer llama.cpp names (gpt-2, smollm, llama-bpe, "
            f"qwen2), got {got}; pass --pre-tokenizer NAME (llama.cpp's tokenizer.ggml.pre)"
        )
    n_vocab = int(config["vocab_size"])
    tokens: list[str | None] = [None] * n_vocab
    types = [NORMAL] * n_vocab
    for text, i in model.get("vocab", {}).items():
        if i < n_vocab:
            tokens[i] = text
    for added in spec.get("added_tokens", []):
        i = added["id"]
        if i < n_vocab:
            tokens[i] = added["content"]
            types[i] = CONTROL if added.get("special") else USER_DEFINED
    for i, text in enumerate(tokens):
        if text is None:  # rows the embedding has beyond the tokenizer's vocabulary
            tokens[i] = f"[PAD{i}]"
            types[i] = UNUSED
    special = {
        name: int(config[f"{name}_token_id"])
        for name in ("bos", "eos", "pad")
        if isinstance(config.get(f"{name}_token_id"), int)
    }
    if isinstance(unk := model.get("unk_token"), str) and unk in model.get("vocab", {}):
        special["unk"] = int(model["vocab"][unk])
    template = Path(model_dir) / "chat_template.jinja"
    return GgufVocab(
        tokens=[t for t in tokens if t is not None],
        types=types,
        merges=_merges(model),
        pre=pre,
        special=special,
        add_bos=_adds_bos(spec, special.get("bos")),
        chat_template=template.read_text() if template.is_file() else _config_template(model_dir),
    )


def _adds_bos(spec: dict[str, Any], bos: int | None) -> bool:
    """Whether the tokenizer puts BOS before a single text (its post-processor's template)."""
    post = spec.get("post_processor") or {}
    if bos is None or post.get("type") != "TemplateProcessing":
        return False
    first = (post.get("single") or [{}])[0]
    return "SpecialToken" in first


def _config_template(model_dir: Path) -> str | None:
    file = Path(model_dir) / "tokenizer_config.json"
    if not file.is_file():
        return None
    template = json.loads(file.read_text()).get("chat_template")
    return template if isinstance(template, str) else None

"""The model's vocabulary as raw bytes, the form outlines-core builds its token index from.

A grammar is a regular language over *bytes*, so every token must map back to the exact bytes it
stands for. Byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM) store a token as a string of
"visible" stand-in characters, one per byte (GPT-2's `bytes_to_unicode` table); inverting that
table is the only way to keep a token that holds half of a UTF-8 character exact, since decoding
it as text would turn it into U+FFFD. SentencePiece tokenizers with byte fallback (Llama 2,
Mistral) write a space as U+2581 and raw bytes as `<0xNN>` tokens.

Special tokens (EOS, chat markers) are not text and never enter the map; EOS is allowed by the
constraint processor itself, and only in accepting states. A model whose embedding matrix is
larger than the tokenizer (padded to a multiple of 64 or 128) gets a mask over its own size in
which the padding ids are never allowed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

from quantkit.errors import GrammarError, MissingExtraError

__all__ = ["TokenVocabulary", "byte_decoder", "byte_tokens", "import_outlines_core"]

# Bumped whenever the bytes this module assigns to tokens change, so cached indexes built from
# an older mapping are not reused.
_MAPPING_VERSION = 1


def import_outlines_core() -> Any:
    """outlines_core, or a MissingExtraError naming the `grammar` extra."""
    try:
        import outlines_core
    except ImportError as e:
        raise MissingExtraError("outlines-core", "grammar") from e
    return outlines_core


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> unicode table, inverted: stand-in character -> byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, 0x7F-0xA0,
    0xAD) are shifted to U+0100 and up, in byte order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    visible += range(ord("®"), ord("ÿ") + 1)
    chars = list(visible)
    shifted = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def _byte_level_bytes(token: str) -> bytes | None:
    table = byte_decoder()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError:  # a token outside the table (an added token written as plain text)
        return None


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The `type`s in the fast tokenizer's decoder (a Sequence is flattened)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError(
            f"tokenizer: expected a Hugging Face fast tokenizer (with backend_tokenizer), "
            f"got {type(tokenizer).__name__}"
        )
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {p.get("type", "") for p in parts}


@dataclass(frozen=True)
class TokenVocabulary:
    """Token id -> raw bytes for every ordinary token, plus the ids that end a sequence.

    size: the width of the model's logits (>= every id here); ids without bytes (padding,
        special tokens) are never allowed by a grammar.
    token_bytes: id -> bytes, special tokens and EOS excluded.
    eos_token_ids: every id that ends a sequence; allowed only where the grammar is complete.
    encode: the tokenizer's own encoding of UTF-8 text (no special tokens), which llguidance
        uses for its canonical fast-forward tokens; None (hand-built vocabularies): greedy
        longest match over `token_bytes`. Not part of the fingerprint.
    """

    size: int
    token_bytes: Mapping[int, bytes]
    eos_token_ids: frozenset[int]
    encode: Callable[[bytes], list[int]] | None = field(default=None, compare=False, repr=False)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise GrammarError("vocabulary: expected at least one EOS token id, got none")
        bad = [i for i in (*self.token_bytes, *self.eos_token_ids) if not 0 <= i < self.size]
        if bad:
            raise GrammarError(f"vocabulary: expected token ids in [0, {self.size}), got {bad[0]}")
        clash = sorted(self.eos_token_ids & set(self.token_bytes))
        if clash:
            raise GrammarError(f"vocabulary: EOS ids must not have bytes, got bytes for {clash}")
        digest = hashlib.sha256(f"v{_MAPPING_VERSION}:{self.size}:".encode())
        digest.update(json.dumps(sorted(self.eos_token_ids)).encode())
        for token_id in sorted(self.token_bytes):
            data = self.token_bytes[token_id]
            digest.update(token_id.to_bytes(4, "little") + len(data).to_bytes(4, "little") + data)
        object.__setattr__(self, "fingerprint", digest.hexdigest()[:24])

    @classmethod
    def from_bytes(
        cls, token_bytes: Mapping[int, bytes], *, eos_token_ids: Iterable[int], size: int
    ) -> TokenVocabulary:
        """A hand-built vocabulary (tests, custom tokenizers)."""
        eos = frozenset(int(i) for i in eos_token_ids)
        return cls(size=size, token_bytes=dict(token_bytes), eos_token_ids=eos)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, *, eos_token_ids: Iterable[int] = (), vocab_size: int | None = None
    ) -> TokenVocabulary:
        """The byte map of a Hugging Face fast tokenizer.

        eos_token_ids: ids that end a sequence besides the tokenizer's own eos_token_id (pass
            `quantkit.runtime.generate.eos_token_ids(...)` so generation_config.json's are
            included).
        vocab_size: the model's logits width (config.json vocab_size); default: the tokenizer's
            size. Tokens with ids >= vocab_size cannot be produced by the model and are dropped.
        """
        kinds = _decoder_kinds(tokenizer)
        if "ByteLevel" in kinds:
            convert = _byte_level_bytes
        elif kinds & {"ByteFallback", "Metaspace", "Replace"}:
            convert = _sentencepiece_bytes
        else:
            raise GrammarError(
                f"tokenizer decoder: expected ByteLevel (byte-level BPE) or Metaspace/ByteFallback "
                f"(SentencePiece), got {sorted(kinds) or 'none'}"
            )
        vocab: dict[str, int] = tokenizer.get_vocab()
        size = vocab_size if vocab_size is not None else max(vocab.values()) + 1
        eos = {int(i) for i in eos_token_ids}
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        eos = {i for i in eos if i < size}
        special = set(getattr(tokenizer, "all_special_ids", ())) | eos
        added = {
            tok.content
            for tok in getattr(tokenizer, "added_tokens_decoder", {}).values()
            if getattr(tok, "special", False)
        }
        table: dict[int, bytes] = {}
        for text, token_id in vocab.items():
            if token_id in special or token_id >= size or text in added:
                continue
            data = convert(text)
            if data is None:  # a non-special added token, stored as plain text
                data = text.encode("utf-8")
            if data:
                table[token_id] = data

        # llguidance calls this while it computes masks (the text a grammar forces: 6572
        # calls over 14907 mask steps of 60 benchmark schemas, 2287 distinct), so it is the
        # fast tokenizer's own encode (what tokenizer.encode runs, without its 16 us of Python
        # around it: 24.7 -> 8.3 us a call), and repeated texts are remembered.
        backend = getattr(tokenizer, "backend_tokenizer", None)

        @lru_cache(maxsize=8192)
        def encode_text(text: str) -> tuple[int, ...]:
            if backend is not None:
                return tuple(backend.encode(text, add_special_tokens=False).ids)
            return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))

        def encode(data: bytes) -> list[int]:
            return list(encode_text(data.decode("utf-8", errors="replace")))

        return cls(size=size, token_bytes=table, eos_token_ids=frozenset(eos), encode=encode)

    @property
    def outlines_eos(self) -> int:
        """The one EOS id outlines-core is told about (it takes one); the others are added to
        the mask by the processor."""
        return min(self.eos_token_ids)

    def to_outlines(self) -> Any:
        """An `outlines_core.Vocabulary` (same bytes; several ids may share bytes)."""
        oc = import_outlines_core()
        grouped: dict[bytes, list[int]] = {}
        for token_id, data in self.token_bytes.items():
            grouped.setdefault(data, []).append(token_id)
        return oc.Vocabulary(self.outlines_eos, grouped)


_BYTE_TOKENS: dict[str, dict[int, int]] = {}


def byte_tokens(vocabulary: TokenVocabulary) -> dict[int, int]:
    """byte -> the lowest id of a token that is exactly that byte; built once per vocabulary
    (130 ms for 49k tokens, which every new processor paid before: once per request)."""
    found = _BYTE_TOKENS.get(vocabulary.fingerprint)
    if found is None:
        found = {}
        for token_id, data in vocabulary.token_bytes.items():
            if len(data) == 1 and token_id < found.get(data[0], token_id + 1):
                found[data[0]] = token_id
        _BYTE_TOKENS[vocabulary.fingerprint] = found
    return found

"""The grammar's bitmask on logits: the C pass (`fused_kernels.cpu.logit_mask`) against the
numpy path and a per-token reading of the bits, for the shapes a step brings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantkit.fused_kernels.cpu.logit_mask import mask_logits, mask_logits_available
from quantkit.grammar import processor as processor_mod

needs_c = pytest.mark.skipif(not mask_logits_available(), reason="needs gcc (C kernels)")


def _bits(rows: int, vocab: int, seed: int) -> np.ndarray:
    """Random masks with the word kinds the pass special-cases: all clear, all set, mixed."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=(rows, (vocab + 31) // 32), dtype=np.uint64)
    words = words.astype(np.uint32)
    words[:, ::5] = 0
    words[:, 1::7] = 0xFFFFFFFF
    return words.view(np.int32)


def _expected(logits: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """Bit v of the row's word v // 32, read one token at a time."""
    rows, vocab = logits.shape
    words = bits.view(np.uint32)
    out = torch.full_like(logits, float("-inf"))
    for r in range(rows):
        for v in range(vocab):
            if (int(words[r, v >> 5]) >> (v & 31)) & 1:
                out[r, v] = logits[r, v]
    return out


@needs_c
@pytest.mark.parametrize("rows, vocab", [(1, 32), (1, 100), (3, 257), (2, 1031)])
def test_c_pass_equals_a_per_token_reading(rows: int, vocab: int) -> None:
    logits = torch.randn(rows, vocab)
    bits = _bits(rows, vocab, seed=vocab)
    got = mask_logits(logits, bits)
    assert torch.equal(got, _expected(logits, bits))
    assert got.data_ptr() != logits.data_ptr()  # a new tensor: the caller's logits stay
    assert torch.isfinite(logits).all()


@needs_c
def test_c_pass_reads_rows_by_stride_and_padded_masks() -> None:
    wide = torch.randn(3, 80)
    logits = wide[:, :70]  # rows 80 apart, 70 wide: a step's logits cut to the vocabulary
    bits = _bits(3, 96, seed=1)  # more words than 70 tokens need
    assert torch.equal(mask_logits(logits, bits), _expected(logits, bits[:, :3]))


@needs_c
def test_the_processor_path_is_the_same_with_and_without_c(monkeypatch) -> None:
    logits = torch.randn(2, 4099)
    bits = _bits(2, 4099, seed=3)
    with_c = processor_mod._apply_mask(logits, bits)
    monkeypatch.setattr(processor_mod, "_c_mask", lambda: False)
    assert torch.equal(processor_mod._apply_mask(logits, bits), with_c)


@needs_c
def test_c_pass_writes_into_a_given_buffer() -> None:
    """`out` given: the same values, written there (the processor reuses one buffer a step)."""
    logits = torch.randn(2, 300)
    bits = _bits(2, 300, seed=5)
    out = torch.full((2, 300), 7.0)
    got = mask_logits(logits, bits, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, _expected(logits, bits))
    with pytest.raises(ValueError, match="expected out float32"):
        mask_logits(logits, bits, out=torch.zeros(2, 299))
    with pytest.raises(ValueError, match="apart from logits"):
        mask_logits(logits, bits, out=logits)


def test_bad_shapes_are_one_line() -> None:
    with pytest.raises(ValueError, match="expected float32"):
        mask_logits(torch.zeros(2, 64, dtype=torch.float64), np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="expected a bitmask"):
        mask_logits(torch.zeros(2, 64), np.zeros((2, 1), np.int32))

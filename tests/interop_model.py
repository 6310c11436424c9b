"""The tiny random Llama the interop tests (INT4/FP8, INT8, FP4) hand to transformers."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

PROMPTS = [[1, 17, 300, 42, 5, 511], [1, 2, 3], [7, 100, 200, 300, 400, 450, 500, 8, 9]]


def tiny_llama(directory: Path) -> transformers.LlamaForCausalLM:
    """A LlamaForCausalLM drawn with seed 0 (2 layers, hidden 128, vocabulary 512), saved at
    `directory` as a plain HF model; returned in eval mode."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model

"""Tiny random models of every supported family, built with transformers' own config classes
(seeded, hidden 64, 2-4 layers), and the oracle helpers the family tests share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
SLIDING_WINDOW = 8  # shorter than the test prompts: the sliding layers' mask matters

# family -> (transformers config class, its arguments beyond COMMON)
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        {
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),  # fmt: skip
    "mistral": (
        "MistralConfig",
        {"num_hidden_layers": 2, "sliding_window": SLIDING_WINDOW, "tie_word_embeddings": False},
    ),
    "qwen2": ("Qwen2Config", {"num_hidden_layers": 2, "tie_word_embeddings": True}),
    "qwen3": (
        "Qwen3Config",
        {"num_hidden_layers": 2, "head_dim": 32, "tie_word_embeddings": True},
    ),
    "phi3": (
        "Phi3Config",
        {"num_hidden_layers": 2, "sliding_window": SLIDING_WINDOW, "tie_word_embeddings": False},
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": SLIDING_WINDOW,
            "attn_logit_softcapping": 0.2,
            "final_logit_softcapping": 0.5,
        },
    ),  # fmt: skip
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 2,
        },
    ),  # fmt: skip
}
FAMILIES = tuple(FAMILY_CONFIGS)
# The mixture-of-experts families, tested apart (tests/test_family_moe*.py): 4 experts, 2 per
# token, so on 256 calibration tokens every expert is routed some and one can be starved.
MOE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": (
        "MixtralConfig",
        {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
         "intermediate_size": 64, "tie_word_embeddings": False},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_hidden_layers": 2, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 64, "norm_topk_prob": True, "tie_word_embeddings": False},
    ),
}  # fmt: skip
MOE_FAMILIES = tuple(MOE_CONFIGS)


def make_family_model(name: str, path: Path, *, seed: int = 0, **sizes: Any) -> Path:
    """Save a random transformers model of family `name` (fp32, perturbed norms) at `path`;
    sizes: config arguments that replace the family's (hidden_size, ...)."""
    import transformers

    cls, extra = {**FAMILY_CONFIGS, **MOE_CONFIGS}[name]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**{**COMMON, **extra, **sizes})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # init leaves norms at identity, biases 0: perturb so both show
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "torch_dtype": "float32"}))
    return path


def padded_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Three right-padded prompts (lengths 21, 13, 5: past the sliding window) and their
    attention mask."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (21, 13, 5)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, COMMON["vocab_size"], (n,), generator=gen)
        mask[row, :n] = 1
    return ids, mask


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got - want).abs().max() / want.abs().max())


# fp32 on both sides, the same op order (and, for MoE, the same expert order and index_add):
# measured 0.0 for every family.
ORACLE_MAX_REL_ERR = 1e-4


def assert_logits_match_transformers(name: str, ref: Any, ours: Any) -> None:
    """quantkit's dense logits equal transformers' on a right-padded batch (real tokens only)."""
    ids, mask = padded_batch()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids)
    for row, n in enumerate(mask.sum(1).tolist()):
        assert max_rel_err(got[row, :n], want[row, :n]) <= ORACLE_MAX_REL_ERR, (name, row)


def assert_greedy_matches_transformers(name: str, ref: Any, ours: Any) -> None:
    """32 greedy tokens: two prompts batched by quantkit (KV cache, positions past the sliding
    window), one at a time by transformers' `generate`."""
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    ids, mask = padded_batch(seed=3)
    prompts = [ids[r, :n].tolist() for r, n in enumerate(mask.sum(1).tolist()[:2])]
    got = generate(ours, prompts, SamplingParams(max_new_tokens=32)).tokens
    for row, prompt in enumerate(prompts):
        out = ref.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
            pad_token_id=0,
        )  # fmt: skip
        assert got[row] == out[0, len(prompt) :].tolist(), (name, row)

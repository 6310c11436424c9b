"""quantkit's decoder against transformers' own implementation, on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.errors import ModelSourceError
from quantkit.models.decoder import ModelConfig, build_model
from tests.conftest import make_hf_model


def _load_both(path: Path):
    import transformers
    from safetensors.torch import load_file

    ref = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    config = json.loads((path / "config.json").read_text())
    ours = build_model(config, load_file(path / "model.safetensors"))
    return ref.eval(), ours


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": False},
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
        {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None},
    ],
    ids=["llama-tied", "llama-untied", "qwen2", "mistral"],
)
def test_logits_match_transformers(tmp_path: Path, overrides: dict) -> None:
    ref, ours = _load_both(make_hf_model(tmp_path, overrides))
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cached_decode_matches_full_forward(tiny_llama_dir: Path) -> None:
    _, model = _load_both(tiny_llama_dir)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        model.setup_cache(batch=1, max_len=16)
        steps = []
        for t in range(12):
            pos = torch.tensor([[t]])
            mask = (torch.arange(16) <= t).view(1, 1, 1, 16)
            steps.append(model(ids[:, t : t + 1], positions=pos, mask=mask))
        model.drop_cache()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_unsupported_family_lists_supported() -> None:
    with pytest.raises(ModelSourceError, match="expected model_type one of llama, mistral, qwen2"):
        ModelConfig.from_dict({"model_type": "gpt2"})

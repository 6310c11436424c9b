"""Every supported family's dense forward and greedy generation against transformers' own
(the oracle), on tiny random models built with each family's transformers config class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantkit.models.decoder import CausalLM, build_model
from tests.family_models import (
    FAMILIES,
    assert_greedy_matches_transformers,
    assert_logits_match_transformers,
    make_family_model,
    max_rel_err,
    padded_batch,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory) -> tuple[str, Path, object, CausalLM]:
    """(family, directory, the transformers model, quantkit's dense model of it)."""
    name = request.param
    path = make_family_model(name, tmp_path_factory.mktemp(name))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = json.loads((path / "config.json").read_text())
    return name, path, ref, build_model(config, load_file(path / "model.safetensors"))


def test_dense_logits_match_transformers(family_model) -> None:
    name, _, ref, ours = family_model
    assert ours.family.name == {"llama3": "llama"}.get(name, name)
    assert_logits_match_transformers(name, ref, ours)


def test_greedy_generate_matches_transformers(family_model) -> None:
    """32 greedy tokens, two prompts batched by quantkit (KV cache, positions past the
    sliding window), one at a time by transformers."""
    name, _, ref, ours = family_model
    assert_greedy_matches_transformers(name, ref, ours)


def test_the_options_the_test_models_set_change_the_forward(family_model) -> None:
    """The oracle match is not vacuous: dropping what makes the family differ from Llama
    (rope scaling, biases, q/k norms, sliding window, soft-capping, local rope) changes the
    logits."""
    name, path, _, ours = family_model
    config = json.loads((path / "config.json").read_text())
    state = load_file(path / "model.safetensors")
    change = {
        "llama3": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        "phi3": {"sliding_window": None},
        "mistral": {"sliding_window": None},
        "gemma2": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
        "gemma3_text": {"layer_types": ["full_attention"] * config["num_hidden_layers"]},
    }.get(name, {})
    for key in [k for k in state if k.endswith(("q_proj.bias", "q_norm.weight"))]:
        state[key] = torch.zeros_like(state[key])  # qwen2's bias, qwen3's per-head norm
    assert change or name in ("qwen2", "qwen3")
    other = build_model({**config, **change}, state)
    ids, _ = padded_batch()
    with torch.no_grad():
        assert max_rel_err(other(ids), ours(ids)) > 1e-3


def test_a_final_soft_cap_taken_in_place_is_the_formula(tmp_path: Path) -> None:
    """Without autograd the final soft-cap is taken in place (two vocabulary-wide copies
    fewer); with it, out of place: the same logits either way."""
    path = make_family_model("gemma2", tmp_path)
    config = json.loads((path / "config.json").read_text())
    ours = build_model(config, load_file(path / "model.safetensors"))
    assert ours.config.final_softcap is not None
    ids, _ = padded_batch()
    with torch.no_grad():
        in_place = ours(ids)
    with torch.enable_grad():
        formula = ours(ids)
    assert formula.requires_grad
    assert torch.equal(formula.detach(), in_place)
    assert in_place.abs().max() <= ours.config.final_softcap

"""The mixture-of-experts families (Mixtral, Qwen3-MoE): the dense forward and greedy
generation against transformers' own on tiny random models (4 experts, 2 per token), which
decode step runs them, the roofline's parameter count, and the configs quantkit refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantkit.errors import ModelSourceError
from quantkit.models.config import ModelConfig
from quantkit.models.decoder import CausalLM, build_model
from quantkit.perf.roofline import ModelShape
from tests.family_models import (
    MOE_FAMILIES,
    assert_greedy_matches_transformers,
    assert_logits_match_transformers,
    make_family_model,
    max_rel_err,
    padded_batch,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_model(request, tmp_path_factory) -> tuple[str, Path, object, CausalLM]:
    """(family, directory, the transformers model, quantkit's dense model of it)."""
    name = request.param
    path = make_family_model(name, tmp_path_factory.mktemp(name))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = json.loads((path / "config.json").read_text())
    return name, path, ref, build_model(config, load_file(path / "model.safetensors"))


def test_dense_logits_match_transformers(moe_model) -> None:
    name, _, ref, ours = moe_model
    assert ours.family.name == name and ours.config.moe is not None
    assert_logits_match_transformers(name, ref, ours)


def test_greedy_generate_matches_transformers(moe_model) -> None:
    name, _, ref, ours = moe_model
    assert_greedy_matches_transformers(name, ref, ours)


def test_routing_options_change_the_forward(moe_model) -> None:
    """The oracle match is not vacuous: one expert per token instead of two (and for Qwen3-MoE
    unnormalized weights) changes the logits."""
    name, path, _, ours = moe_model
    config = json.loads((path / "config.json").read_text())
    state = load_file(path / "model.safetensors")
    ids, _ = padded_batch()
    for change in ({"num_experts_per_tok": 1}, {"norm_topk_prob": False}):
        if name == "mixtral" and "norm_topk_prob" in change:
            continue  # Mixtral always renormalizes
        with torch.no_grad():
            other = build_model({**config, **change}, state)(ids)
            assert max_rel_err(other, ours(ids)) > 1e-3, change


def test_roofline_counts_the_real_parameters(moe_model) -> None:
    name, path, _, _ = moe_model
    state = load_file(path / "model.safetensors")
    assert ModelShape.from_file(path).n_params.total == sum(t.numel() for t in state.values())


def test_the_c_step_takes_the_family(moe_model) -> None:
    """Nothing in a MoE family's config keeps it off the C step (tests/test_family_c_step.py
    holds the step to the PyTorch layers)."""
    _, _, _, ours = moe_model
    assert ours.config.pytorch_only() is None


@pytest.mark.parametrize(
    "change,field",
    [
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts": 0}, "num_experts"),
    ],
    ids=["dense-layers", "sparse-step", "top-k", "experts"],
)
def test_unimplemented_moe_options_name_the_field(change: dict, field: str) -> None:
    from tests.conftest import TINY_LLAMA

    config = {**TINY_LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}
    config.update(change)
    with pytest.raises(ModelSourceError, match=f"config.json {field}: expected"):
        ModelConfig.from_dict(config)

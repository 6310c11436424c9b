"""AWQ and RTN on a tiny random model: folding is exact, the search never loses to RTN."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import build_model
from quantkit.quantize.awq import AwqConfig, _fold, awq_quantize
from quantkit.quantize.rtn import rtn_quantize_weight


def _tiny(path: Path):
    config = json.loads((path / "config.json").read_text())
    return config, build_model(config, load_file(path / "model.safetensors"))


def _samples(n: int = 8, t: int = 32) -> torch.Tensor:
    # Zipf-like token draw: a few tokens dominate, as in real text, so channels differ in scale.
    probs = 1.0 / torch.arange(1, 513, dtype=torch.float32)
    return torch.multinomial(
        probs, n * t, replacement=True, generator=torch.Generator().manual_seed(0)
    ).view(n, t)


def test_fold_preserves_the_function(tiny_llama_dir: Path) -> None:
    config, model = _tiny(tiny_llama_dir)
    ids = _samples(2, 16)
    with torch.no_grad():
        before = model(ids)
        layer = model.model.layers[0]
        for group in model.family.scale_groups:
            k = layer.get_submodule(group.linears[0]).in_features
            _fold(layer, group, torch.rand(k) + 0.5)
        after = model(ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group_size,symmetric", [(32, False), (64, True), (-1, False)])
def test_awq_beats_rtn_per_layer(tiny_llama_dir: Path, group_size: int, symmetric: bool) -> None:
    config, model = _tiny(tiny_llama_dir)
    scheme = QuantScheme("int4", group_size, symmetric)
    cfg = AwqConfig(grid=10, search_tokens=128, clip_tokens=64, batch_sequences=4)
    weights, reports = awq_quantize(model, _samples(), scheme=scheme, cfg=cfg)
    assert len(weights) == 2 * 7
    for r in reports:
        # Identity is always a candidate and clipping only lowers per-group error, so the
        # layer output can only get closer to fp than RTN's (small slack for clip interplay).
        assert r.method_error <= r.rtn_error * 1.05, r
        for g in r.groups:
            assert g.awq_loss <= g.rtn_loss
    # The model now computes with exactly the dequantized INT4 weights.
    q = weights["model.layers.1.mlp.down_proj"]
    g = 256 if group_size == -1 else group_size
    torch.testing.assert_close(
        model.model.layers[1].mlp.down_proj.weight, q.dequantize(group_size=g, dtype=torch.float32)
    )
    assert int(q.codes.min()) >= -8 and int(q.codes.max()) <= 7


def test_rtn_codes_hand_example() -> None:
    # One group of 4: range [-1, 2] -> scale 3/15 = 0.2, zp = round(1/0.2) - 8 = -3.
    w = torch.tensor([[-1.0, 0.0, 1.0, 2.0]])
    q = rtn_quantize_weight(w, scheme=QuantScheme("int4", -1).resolve([("l", 4)]))
    assert torch.equal(q.zero, torch.tensor([[-3]], dtype=torch.int32))
    assert torch.equal(q.codes, torch.tensor([[-8, -3, 2, 7]], dtype=torch.int8))
    torch.testing.assert_close(q.scale, torch.tensor([[0.2]]))
    _ = copy.deepcopy(q)

"""A written checkpoint runs through QuantLinear exactly like its dequantized dense twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.errors import CheckpointError, ModelSourceError
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import build_model
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.loader import load_model
from quantkit.runtime.quant_linear import QuantLinear


@pytest.mark.parametrize("group_size,symmetric", [(32, False), (-1, True)])
def test_checkpoint_runs_like_dequantized_model(
    tmp_path: Path, tiny_model_dir: Path, group_size: int, symmetric: bool
) -> None:
    outcome = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", group_size, symmetric))
    out = outcome.save(tmp_path / "ckpt", source_dir=tiny_model_dir)
    loaded = load_model(out)
    assert loaded.scheme == outcome.scheme
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, QuantLinear)
    assert loaded.tokenizer is not None
    dense = build_model(outcome.config, outcome.dense_state())
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), dense(ids), rtol=1e-5, atol=1e-5)


def test_not_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises((ModelSourceError, CheckpointError), match="config.json"):
        load_model(tmp_path)

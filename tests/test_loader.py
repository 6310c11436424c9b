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


@pytest.fixture(scope="module", params=["int4", "fp8"])
def quant_ckpt(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Path:
    scheme = (
        QuantScheme("int4", 32, False) if request.param == "int4" else QuantScheme("fp8", -1, True)
    )
    outcome = quantize_model(tiny_model_dir, scheme=scheme)
    return outcome.save(tmp_path_factory.mktemp("loader") / "ckpt", source_dir=tiny_model_dir)


def test_each_module_is_validated_once(quant_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_checkpoint validates every quantized module; QuantLinear.from_tensors, called by the
    loader with validated=True, does not run the validator again."""
    import quantkit.format.checkpoint as checkpoint
    import quantkit.runtime.loader as loader
    import quantkit.runtime.quant_linear as quant_linear
    from quantkit.format.tensors import check_module_tensors

    calls: list[str] = []

    def counting(tensors, *, scheme, prefix=""):  # type: ignore[no-untyped-def]
        calls.append(prefix or "<from_tensors>")
        return check_module_tensors(tensors, scheme=scheme, prefix=prefix)

    monkeypatch.setattr(checkpoint, "check_module_tensors", counting)
    monkeypatch.setattr(quant_linear, "check_module_tensors", counting)
    # Fusion builds new modules (q/k/v, gate/up as one), which it validates as such: not here.
    monkeypatch.setattr(loader, "fuse_projections", lambda model: None)
    model = load_model(quant_ckpt, tokenizer=False).model
    quantized = [name for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert quantized and sorted(calls) == sorted(quantized)


def test_a_bad_module_still_fails_with_the_checkpoint_error(
    quant_ckpt: Path, tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from quantkit.format.checkpoint import load_checkpoint

    out = shutil.copytree(quant_ckpt, tmp_path / "bad")
    shard = sorted(out.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = sorted(k for k in tensors if k.endswith(".weight_scale"))[0]
    tensors[name] = tensors[name][:-1].contiguous()  # one row short
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as direct:
        load_checkpoint(out)
    with pytest.raises(CheckpointError, match=rf"tensor {name}: expected shape") as loaded:
        load_model(out, tokenizer=False)
    assert str(loaded.value) == str(direct.value)

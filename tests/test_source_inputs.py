"""A damaged or inconsistent source model given to `quantkit quantize`: one line naming the file
and what is wrong (exit 3, never "internal error"), nothing written, and a config that claims
other layers than the weights hold refused before any tensor is read."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import make_hf_model, make_tokenizer, run_cli

DATA = 3


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense model in two shards with an index."""
    path = make_tokenizer(make_hf_model(tmp_path_factory.mktemp("src")))
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    weight_map = {}
    for file, keys in half.items():
        save_file({k: tensors[k] for k in keys}, path / file)
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _shard(p: Path) -> Path:
    return p / "model-00002-of-00002.safetensors"


def _truncate(p: Path) -> None:
    data = _shard(p).read_bytes()
    _shard(p).write_bytes(data[: len(data) * 2 // 3])


def _corrupt_header(p: Path) -> None:
    data = bytearray(_shard(p).read_bytes())
    data[8:20] = b"not json at "  # the header's first bytes: JSON no longer
    _shard(p).write_bytes(bytes(data))


def _drop_shard(p: Path) -> None:
    _shard(p).unlink()


def _edit_index(p: Path) -> None:
    index = json.loads((p / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.mlp.extra.weight"] = "model-00002-of-00002.safetensors"
    (p / "model.safetensors.index.json").write_text(json.dumps(index))


def _config(**changes: object) -> Callable[[Path], None]:
    def edit(p: Path) -> None:
        config = json.loads((p / "config.json").read_text())
        config.update(changes)
        (p / "config.json").write_text(json.dumps(config))

    return edit


CASES = [
    ("truncated-shard", _truncate, "expected a complete safetensors file"),
    ("corrupt-header", _corrupt_header, "expected a complete safetensors file"),
    ("shard-missing", _drop_shard, "lists shards that are missing"),
    ("index-names-a-tensor-no-shard-holds", _edit_index, "which does not hold it"),
    ("config-other-widths", _config(intermediate_size=96), "does not describe these weights"),
    ("config-100000-layers", _config(num_hidden_layers=100000), "expected num_hidden_layers 2"),
]


@pytest.mark.parametrize("damage,needle", [(d, n) for _, d, n in CASES], ids=[c[0] for c in CASES])
def test_a_bad_source_is_one_line_and_writes_nothing(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
    needle: str,
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    damage(bad)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "quantize", str(bad), "--method", "rtn", "--eval-tokens", "0",
                           "-o", str(out))  # fmt: skip
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == DATA and len(lines) == 1 and needle in lines[0], (code, err)
    assert "internal error" not in err and "Traceback" not in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["bad"]


def test_a_config_with_other_layers_is_refused_before_any_tensor_is_read(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import quantkit.quantize.pipeline as pipeline

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were read for a config that does not fit them")

    monkeypatch.setattr(pipeline, "load_state_dict", never)
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    _config(num_hidden_layers=100000)(bad)
    code, _, err = run_cli(capsys, "quantize", str(bad), "--method", "rtn", "--eval-tokens", "0",
                           "-o", str(tmp_path / "out"))  # fmt: skip
    assert code == DATA and "(the weights hold layers 0-1), got 100000" in err, err


def test_the_undamaged_source_quantizes(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "quantize", str(source), "--method", "rtn", "--eval-tokens",
                           "0", "-o", str(out))  # fmt: skip
    assert code == 0, err
    assert (out / "config.json").exists()

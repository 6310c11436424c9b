"""Damaged model caches under `$QUANTKIT_HOME`: a converted GGUF and the embedded model's INT4
checkpoint are checked against their manifest before use; a truncated, emptied or overwritten
file, or a missing one, is made again with exactly one warning, and the rebuilt entry equals a
clean one byte for byte (so every run's output equals a clean cache's). An entry an older
quantkit made (no manifest) is adopted silently. The calibration-text cache's damage test is in
test_calibration; the kernel, grammar and bandwidth caches' in test_hostile_inputs."""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from quantkit.cache_manifest import MANIFEST_NAME, has_manifest, manifest_damage
from quantkit.sources.resolve import resolve_model
from tests.test_sources import write_tiny_gguf


def _hashes(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.name != MANIFEST_NAME
    }


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _garbage_same_size(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


def _flip_a_byte_same_size(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _remove(p: Path) -> None:
    p.unlink()


DAMAGES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "weights-truncated": ("model.safetensors", _truncate, "expected"),
    "weights-emptied": ("model.safetensors", _empty, "got 0"),
    "weights-overwritten": ("model.safetensors", _garbage_same_size, "SHA-256"),
    "weights-one-bit": ("model.safetensors", _flip_a_byte_same_size, "SHA-256"),
    "tokenizer-removed": ("tokenizer.json", _remove, "tokenizer.json is missing"),
    "config-overwritten": ("config.json", _garbage_same_size, "SHA-256"),
    "manifest-garbage": (MANIFEST_NAME, _garbage_same_size, "manifest is unreadable"),
}


def _one_warning(caught: list[warnings.WarningMessage], needle: str) -> str:
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and needle in lines[0] and "damaged" in lines[0], lines
    return lines[0]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_gguf(path, tied=True)
    return path


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_a_damaged_conversion_is_made_again_with_one_warning(
    gguf_file: Path, tmp_path: Path, damage: str
) -> None:
    home = tmp_path / "home"
    target = resolve_model(gguf_file, home=home, progress=False)
    clean = _hashes(target)
    assert has_manifest(target) and manifest_damage(target) is None
    name, spoil, needle = DAMAGES[damage]
    spoil(target / name)
    assert manifest_damage(target) is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = resolve_model(gguf_file, home=home, progress=False)
    line = _one_warning(caught, needle)
    assert line.startswith(f"model cache {target}: damaged (") and "converting again" in line
    assert again == target and _hashes(target) == clean and manifest_damage(target) is None
    with warnings.catch_warnings(record=True) as caught:  # whole again: nothing to say
        warnings.simplefilter("always")
        assert resolve_model(gguf_file, home=home, progress=False) == target
    assert caught == []


def test_the_rebuilt_conversion_gives_the_clean_logits(gguf_file: Path, tmp_path: Path) -> None:
    from quantkit.runtime.loader import load_model

    home = tmp_path / "home"
    target = resolve_model(gguf_file, home=home, progress=False)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.inference_mode():
        clean = load_model(target, tokenizer=False).model(ids)
        _truncate(target / "model.safetensors")
        with pytest.warns(UserWarning, match="damaged"):
            again = resolve_model(gguf_file, home=home, progress=False)
        assert torch.equal(load_model(again, tokenizer=False).model(ids), clean)


def test_a_conversion_without_a_manifest_is_adopted(gguf_file: Path, tmp_path: Path) -> None:
    """Converted by an older quantkit: used as before, and checked from now on."""
    home = tmp_path / "home"
    target = resolve_model(gguf_file, home=home, progress=False)
    (target / MANIFEST_NAME).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_model(gguf_file, home=home, progress=False) == target
    assert caught == [] and has_manifest(target) and manifest_damage(target) is None


# ------------------------------------------------------------- the embedded INT4 checkpoint


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    outcome = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", "auto"))
    return outcome.save(tmp_path_factory.mktemp("embedded") / "ckpt", source_dir=tiny_model_dir)


@pytest.mark.parametrize(
    "damage", ["weights-truncated", "weights-overwritten", "tokenizer-removed", "manifest-garbage"]
)
def test_a_damaged_embedded_checkpoint_is_quantized_again(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """AWQ of the real embedded model takes minutes: here "quantizing" writes the tiny
    checkpoint, so the test checks the cache's logic, not AWQ (make demo runs the real one)."""
    from quantkit.quantize import embedded

    made: list[Path] = []

    def quantize(target: Path, *, home: Path | None, progress: bool) -> None:
        made.append(target)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tiny_ckpt, target)

    monkeypatch.setattr(embedded, "_quantize_embedded", quantize)
    home = tmp_path / "home"
    target = embedded.ensure_embedded_int4(home=home, progress=False, log=lambda _m: None)
    clean = _hashes(target)
    assert len(made) == 1 and manifest_damage(target) is None
    name, spoil, needle = DAMAGES[damage]
    spoil(target / name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = embedded.ensure_embedded_int4(home=home, progress=False, log=lambda _m: None)
    line = _one_warning(caught, needle)
    assert line.startswith(f"checkpoint cache {target}: damaged (") and "quantizing again" in line
    assert again == target and len(made) == 2 and _hashes(target) == clean
    assert embedded.ensure_embedded_int4(home=home, progress=False) == target and len(made) == 2

"""Streaming quantization (one decoder layer at a time from the source files) writes exactly
what the in-memory pipeline writes, for every family and algorithm, and a run killed after any
layer resumes to the same bytes; a different command refuses the staging directory it left."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.errors import CheckpointError
from quantkit.format.checkpoint import save_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.pipeline import QuantizeOutcome, quantize_model
from quantkit.quantize.source_model import open_source
from quantkit.quantize.staging import Staging, staging_dir
from quantkit.quantize.streaming import stream_quantize
from tests.conftest import make_hf_model, make_tokenizer
from tests.family_models import FAMILIES, MOE_FAMILIES, make_family_model

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = {
    "rtn": ("rtn", QuantScheme("int4", 32)),
    "awq": ("awq", QuantScheme("int4", 32)),
    "gptq": ("gptq", QuantScheme("int4", 32)),
    "fp8-gptq": ("gptq", QuantScheme("fp8")),
    "awq+gptq": ("awq+gptq", QuantScheme("int4", 32)),
}
AWQ = AwqConfig(grid=5, search_tokens=128, clip_tokens=32, batch_sequences=4)
# Small shards, so the order in which tensors reach the writer decides where shards split.
SHARD = 40_000


@pytest.fixture(scope="module", params=FAMILIES + MOE_FAMILIES)
def family(request, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    path = make_family_model(request.param, tmp_path_factory.mktemp(request.param))
    ids = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(0))
    return path, ids


def _kwargs(method: str, ids: torch.Tensor) -> dict:
    algorithm, scheme = METHODS[method]
    return {
        "scheme": scheme,
        "algorithm": algorithm,
        "samples": None if algorithm == "rtn" else (lambda: ids),
        "awq": AWQ,
        "gptq": GptqConfig(),
    }


def _save(outcome: QuantizeOutcome, out: Path, source: Path) -> dict[str, bytes]:
    save_checkpoint(
        out, source_dir=source, config=outcome.config, tensors=outcome.tensors,
        scheme=outcome.scheme, algorithm=outcome.algorithm,
        quantized_modules=outcome.quantized_modules, report={}, max_shard_bytes=SHARD,
    )  # fmt: skip
    names = sorted(p.name for p in out.iterdir() if "safetensors" in p.name)
    return {n: (out / n).read_bytes() for n in names}


def _stream(source: Path, staging: Path, method: str, ids: torch.Tensor) -> QuantizeOutcome:
    stage = Staging(staging, {"method": method})
    resumed = stage.open()
    try:
        return stream_quantize(open_source(source), stage, resumed=resumed, **_kwargs(method, ids))
    finally:
        stage.close()


@pytest.mark.parametrize("method", list(METHODS))
def test_streamed_checkpoint_is_byte_identical(family, method: str, tmp_path: Path) -> None:
    path, ids = family
    want = _save(quantize_model(path, **_kwargs(method, ids)), tmp_path / "memory", path)
    got = _save(_stream(path, tmp_path / "stage", method, ids), tmp_path / "stream", path)
    assert len(want) > 2, "expected several shards, so their split is compared too"
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == want[name], name


def test_quantized_head_streams_the_same(tmp_path: Path) -> None:
    path = make_family_model("llama3", tmp_path / "src")
    kwargs = {**_kwargs("rtn", torch.zeros(1, 1)), "quantize_head": True}
    want = _save(quantize_model(path, **kwargs), tmp_path / "memory", path)
    stage = Staging(tmp_path / "stage", {})
    stage.open()
    got = _save(stream_quantize(open_source(path), stage, **kwargs), tmp_path / "stream", path)
    assert got == want


def test_resume_after_a_failed_layer_gives_the_same_bytes(tmp_path: Path, monkeypatch) -> None:
    """A run that dies in layer k keeps layers < k; the next run does only the rest."""
    path = make_family_model("llama3", tmp_path / "src")
    ids = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(1))
    want = _save(_stream(path, tmp_path / "s0", "awq", ids), tmp_path / "whole", path)
    real = Staging.save_layer

    def dies_at_layer_1(self, index, *args):
        if index == 1:
            raise MemoryError("simulated")
        return real(self, index, *args)

    monkeypatch.setattr(Staging, "save_layer", dies_at_layer_1)
    with pytest.raises(MemoryError):
        _stream(path, tmp_path / "s1", "awq", ids)
    monkeypatch.setattr(Staging, "save_layer", real)
    stage = Staging(tmp_path / "s1", {"method": "awq"})
    assert stage.open() == 1
    stage.close()
    stepped: list[int] = []
    monkeypatch.setattr(
        Staging, "save_layer", lambda self, i, *a: (stepped.append(i), real(self, i, *a))
    )
    got = _save(_stream(path, tmp_path / "s1", "awq", ids), tmp_path / "resumed", path)
    assert stepped == [1] and got == want


def test_a_different_run_refuses_the_staging_directory(tmp_path: Path) -> None:
    stage = Staging(tmp_path / "s", {"method": "awq", "calibration": "abc"})
    stage.open()
    stage.close()
    other = Staging(tmp_path / "s", {"method": "awq", "calibration": "def"})
    with pytest.raises(CheckpointError, match=r"different calibration .*--restart"):
        other.open()
    assert other.open(restart=True) == 0


def test_two_runs_cannot_share_a_staging_directory(tmp_path: Path) -> None:
    first = Staging(tmp_path / "s", {})
    first.open()
    with pytest.raises(CheckpointError, match="another quantize run"):
        Staging(tmp_path / "s", {}).open()
    with pytest.raises(CheckpointError, match="another quantize run"):
        Staging(tmp_path / "s", {}).open(restart=True)
    assert (tmp_path / "s" / "manifest.json").is_file()  # --restart emptied nothing
    first.close()


# --------------------------------------------------------------------------- the CLI, SIGKILL

_KILLER = """
import os, signal, sys
import quantkit.quantize.staging as staging
at, where = int(sys.argv[1]), sys.argv[2]
real_layer, real_save = staging.Staging.save_layer, staging.save_shard
def save_layer(self, index, *args):
    if where == "during" and index == at:
        def torn(tensors, path):  # the layer's file half made: written, never renamed
            real_save(tensors, path)
            os.kill(os.getpid(), signal.SIGKILL)
        staging.save_shard = torn
    real_layer(self, index, *args)
    if where == "after" and index == at:
        os.kill(os.getpid(), signal.SIGKILL)
staging.Staging.save_layer = save_layer
from quantkit.cli.main import main
main(sys.argv[3:])
"""


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory) -> tuple[Path, Path, str]:
    """(a 4-layer model with a tokenizer, calibration text, the digest of an uninterrupted
    run's checkpoint)."""
    root = tmp_path_factory.mktemp("cli")
    path = make_tokenizer(make_hf_model(root / "src", {"hidden_size": 64, "num_hidden_layers": 4}))
    calib = root / "calib.txt"
    calib.write_text(" ".join(f"word{i % 97} and more text {i}." for i in range(3000)))
    whole = _run(_args(path, calib, root / "whole"))
    assert whole.returncode == 0, whole.stderr
    return path, calib, _digest(root / "whole")


def _args(model: Path, calib: Path, out: Path, *extra: str) -> list[str]:
    return [
        "quantize", str(model), "--method", "gptq", "--calib", str(calib), "--calib-samples",
        "4", "--calib-seq-len", "32", "--eval-tokens", "0", "-o", str(out), *extra,
    ]  # fmt: skip


def _run(args: list[str], *prefix: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = ["-c", _KILLER, *prefix] if prefix else ["-m", "quantkit.cli.main"]
    return subprocess.run([sys.executable, *code, *args], capture_output=True, text=True, env=env)


def _digest(out: Path) -> str:
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize(("at", "where"), [(0, "after"), (2, "during"), (2, "after")])
def test_sigkill_then_the_same_command_resumes(cli_model, tmp_path: Path, at, where) -> None:
    model, calib, whole = cli_model
    out = tmp_path / "out"
    killed = _run(_args(model, calib, out), str(at), where)
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists() and staging_dir(out).is_dir()
    resumed = _run(_args(model, calib, out))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed      at layer {at + 1 if where == 'after' else at}" in resumed.stdout
    assert _digest(out) == whole
    assert not staging_dir(out).exists()


def test_a_changed_argument_refuses_to_resume(cli_model, tmp_path: Path) -> None:
    model, calib, _ = cli_model
    out = tmp_path / "out"
    assert _run(_args(model, calib, out), "0", "after").returncode == -signal.SIGKILL
    refused = _run(_args(model, calib, out, "--damp", "0.05"))
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "different settings" in line and "--restart" in line
    again = _run(_args(model, calib, out, "--damp", "0.05", "--restart"))
    assert again.returncode == 0, again.stderr

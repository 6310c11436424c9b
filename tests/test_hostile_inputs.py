"""Hostile inputs and broken files through the real CLI: one line, the right exit class, no
traceback, nothing half-written.

Exit classes (`quantkit.cli.main`): 2 usage, 3 input data, 4 environment, 70 a bug (traceback in
a log file), 130 interrupted. Most cases run the CLI in-process (the same `main()` the console
script calls); the ones about process-level behaviour (Ctrl-C during imports) run a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli

USAGE, DATA, ENVIRONMENT, BUG, INTERRUPTED = 2, 3, 4, 70, 130


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def ckpt(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    outcome = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", "auto"))
    out = tmp_path_factory.mktemp("hostile") / "tiny-int4"
    return outcome.save(out, source_dir=tiny_model_dir)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, change: Callable[[dict], object]) -> None:
    cfg = json.loads((path / "config.json").read_text())
    new = change(cfg)
    (path / "config.json").write_text(json.dumps(cfg if new is None else new))


def _edit_tensors(path: Path, change: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _first(tensors: dict, suffix: str) -> str:
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def _narrow(t: torch.Tensor) -> torch.Tensor:
    return t[:, :1].contiguous()


def _nan_scale(t: dict) -> None:
    t[_first(t, "weight_scale")][0, 0] = float("nan")


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


# (id, how to damage a copy of the checkpoint, command after the checkpoint path, class, needle)
DAMAGED: list[tuple[str, Callable[[Path], None], list[str], int, str]] = [
    ("truncated-shard-inspect", _truncate, ["inspect"], DATA, "complete safetensors"),
    ("truncated-shard-generate", _truncate, ["generate"], DATA, "complete safetensors"),
    (
        "empty-shard",
        lambda p: (p / "model.safetensors").write_bytes(b""),
        ["inspect"],
        DATA,
        "safetensors",
    ),
    (
        "four-byte-shard",
        lambda p: (p / "model.safetensors").write_bytes(b"\x00\x01\x02\x03"),
        ["inspect"],
        DATA,
        "safetensors",
    ),
    (
        "garbage-shard",
        lambda p: (p / "model.safetensors").write_bytes(os.urandom(4096)),
        ["generate"],
        DATA,
        "safetensors",
    ),
    (
        "quant-config-list",
        lambda p: _edit_config(p, lambda c: c.update(quantization_config=[1, 2])),
        ["inspect"],
        DATA,
        "quantization_config: expected an object, got list",
    ),
    (
        "quant-config-string",
        lambda p: _edit_config(p, lambda c: c.update(quantization_config="int4")),
        ["inspect"],
        DATA,
        "quantization_config: expected an object, got str",
    ),
    (
        "quant-config-empty-group",
        lambda p: _edit_config(
            p, lambda c: c["quantization_config"].update(config_groups={"group_0": {}})
        ),
        ["inspect"],
        DATA,
        "targets",
    ),
    (
        "quant-config-group-string",
        lambda p: _edit_config(
            p, lambda c: c["quantization_config"].update(config_groups={"group_0": "x"})
        ),
        ["generate"],
        DATA,
        "group_0: expected an object, got str",
    ),
    (
        "config-not-json",
        lambda p: (p / "config.json").write_text("{not json"),
        ["inspect"],
        DATA,
        "config.json",
    ),
    (
        "config-a-list",
        lambda p: (p / "config.json").write_text("[1, 2]"),
        ["generate"],
        DATA,
        "config.json",
    ),
    (
        "config-fewer-layers",
        lambda p: _edit_config(p, lambda c: c.update(num_hidden_layers=1)),
        ["generate"],
        DATA,
        "has no place in",
    ),
    (
        "config-more-layers",
        lambda p: _edit_config(p, lambda c: c.update(num_hidden_layers=3)),
        ["generate"],
        DATA,
        "missing",
    ),
    (
        "config-other-hidden-size",
        lambda p: _edit_config(p, lambda c: c.update(hidden_size=128)),
        ["generate"],
        DATA,
        "the config does not describe these weights",
    ),
    (
        "config-missing-field",
        lambda p: _edit_config(p, lambda c: c.pop("num_attention_heads") and None),
        ["generate"],
        DATA,
        "num_attention_heads",
    ),
    (
        "tensor-wrong-dtype",
        lambda p: _edit_tensors(
            p,
            lambda t: t.update({_first(t, "weight_packed"): t[_first(t, "weight_packed")].long()}),
        ),
        ["inspect"],
        DATA,
        "expected dtype int32, got int64",
    ),
    (
        "tensor-wrong-shape",
        lambda p: _edit_tensors(
            p,
            lambda t: t.update(
                {_first(t, "weight_scale"): t[_first(t, "weight_scale")][:, :1].contiguous()}
            ),
        ),
        ["generate"],
        DATA,
        "expected shape",
    ),
    ("nan-scale", lambda p: _edit_tensors(p, _nan_scale), ["generate"], DATA, "finite"),
    (
        "garbage-tokenizer",
        lambda p: (p / "tokenizer.json").write_text("garbage{"),
        ["generate"],
        DATA,
        "tokenizer",
    ),
    (
        "metadata-not-json",
        lambda p: (p / "quantkit.json").write_text("]["),
        ["inspect"],
        DATA,
        "quantkit.json",
    ),
]


def _check(code: int, err: str, want: int, needle: str) -> None:
    # Progress bars (tqdm, carriage-return redrawn) are progress, not messages.
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln]
    assert "Traceback" not in err, err
    assert code == want and len(lines) == 1, (code, err)
    assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize(
    ("damage", "command", "want", "needle"),
    [case[1:] for case in DAMAGED],
    ids=[case[0] for case in DAMAGED],
)
def test_a_damaged_checkpoint_is_one_line(
    ckpt: Path, tmp_path: Path, capsys, damage, command: list[str], want: int, needle: str
) -> None:
    bad = _copy(ckpt, tmp_path / "bad")
    damage(bad)
    extra = ["--prompt", "hi", "--max-new-tokens", "2"] if command == ["generate"] else []
    code, _, err = run_cli(capsys, *command, str(bad), *extra)
    _check(code, err, want, needle)


GENERATE_ARGS: list[tuple[str, list[str], int, str]] = [
    ("device-bogus", ["--device", "bogus"], USAGE, "--device: expected auto, cpu or cuda"),
    ("device-meta", ["--device", "meta"], USAGE, "--device"),
    ("device-mps", ["--device", "mps"], USAGE, "--device"),
    ("prompt-lone-surrogate", ["--prompt", "a\udcffb"], USAGE, "expected UTF-8 text"),
    ("output-is-a-directory", ["--output", "ADIR"], ENVIRONMENT, "is a directory"),
    ("top-p-out-of-range", ["--top-p", "2"], USAGE, "top_p"),
    ("max-new-tokens-zero", ["--max-new-tokens", "0"], USAGE, "max_new_tokens"),
    ("deep-schema", ["--schema", "DEEP"], DATA, "nested too deeply"),
]


@pytest.mark.parametrize(
    ("args", "want", "needle"),
    [case[1:] for case in GENERATE_ARGS],
    ids=[case[0] for case in GENERATE_ARGS],
)
def test_bad_generate_input_is_one_line(
    ckpt: Path, tmp_path: Path, capsys, args: list[str], want: int, needle: str
) -> None:
    if "DEEP" in args:
        schema: dict = {"type": "object", "properties": {}}
        node = schema
        for _ in range(200):
            child: dict = {"type": "object", "properties": {}}
            node["properties"]["a"] = child
            node = child
        path = tmp_path / "deep.json"
        path.write_text(json.dumps(schema))
        args = [str(path) if a == "DEEP" else a for a in args]
    base = ["--max-new-tokens", "2"] if "--max-new-tokens" not in args else []
    if "--prompt" not in args:
        base += ["--prompt", "hi"]
    (tmp_path / "adir").mkdir()
    args = [str(tmp_path / "adir") if a == "ADIR" else a for a in args]
    code, _, err = run_cli(capsys, "generate", str(ckpt), *base, *args)
    _check(code, err, want, needle)


ROOFLINE_CONFIGS = [
    ("not-json", "not json", "expected a JSON object"),
    ("a-list", "[1]", "expected a JSON object, got list"),
    ("a-string", '"x"', "expected a JSON object, got str"),
    ("missing-fields", '{"model_type": "llama"}', "expected"),
    ("unknown-family", '{"model_type": "gpt-neox"}', "expected"),
]


@pytest.mark.parametrize(
    ("text", "needle"), [c[1:] for c in ROOFLINE_CONFIGS], ids=[c[0] for c in ROOFLINE_CONFIGS]
)
def test_a_bad_roofline_config_is_one_line(tmp_path: Path, capsys, text: str, needle: str):
    cfg = tmp_path / "config.json"
    cfg.write_text(text)
    code, _, err = run_cli(capsys, "roofline", str(cfg))
    _check(code, err, DATA, needle)


def test_quantize_under_a_file_fails_before_any_work(tiny_model_dir: Path, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    start = time.perf_counter()
    code, out, err = run_cli(
        capsys, "quantize", str(tiny_model_dir), "--method", "rtn", "-o", str(tmp_path / "afile/x")
    )
    _check(code, err, DATA, "got a file")
    assert "perplexity" not in out + err  # refused before quantizing, not after
    assert time.perf_counter() - start < 30


def test_force_over_an_existing_checkpoint_survives_a_failed_write(
    tiny_model_dir: Path, ckpt: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """The old checkpoint is byte-identical after a write that failed midway (disk full)."""
    import hashlib

    from quantkit.format import checkpoint

    target = _copy(ckpt, tmp_path / "keep")

    def digest() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in target.iterdir()}

    before = digest()

    def disk_full(*_a, **_k):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device", str(target) + ".tmp")

    monkeypatch.setattr(checkpoint, "_write_tensors", disk_full)
    code, _, err = run_cli(
        capsys, "quantize", str(tiny_model_dir), "--method", "rtn", "-o", str(target), "--force"
    )
    _check(code, err, ENVIRONMENT, "no space left on the device")
    assert digest() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".keep")], "temp left behind"


def test_an_unexpected_error_is_one_line_and_a_log(ckpt: Path, tmp_path: Path, capsys, monkeypatch):
    from quantkit.cli import inspect_cmd

    def boom(*_a, **_k):  # type: ignore[no-untyped-def]
        raise RuntimeError("something nobody expected")

    monkeypatch.setattr(inspect_cmd, "load_checkpoint", boom)
    code, _, err = run_cli(capsys, "inspect", str(ckpt))
    lines = err.strip().splitlines()
    assert code == BUG and len(lines) == 1 and "Traceback" not in err, err
    assert "internal error: RuntimeError: something nobody expected" in lines[0]
    log = Path(lines[0].split("traceback in ")[1].split(";")[0])
    assert log.is_file() and "Traceback" in log.read_text() and "boom" in log.read_text()


def test_a_damaged_kernel_library_is_rebuilt_with_one_warning(tmp_path: Path) -> None:
    from quantkit.fused_kernels import cpu_build

    source = "int answer(void) { return 42; }\n"
    lib = cpu_build.build_library("hostile", source)
    size = lib.stat().st_size
    for damage in (lambda d: d[: len(d) // 3], lambda d: b"", lambda d: os.urandom(len(d))):
        lib.write_bytes(damage(lib.read_bytes()))
        with pytest.warns(UserWarning, match="kernel cache .* damaged .* rebuilding") as seen:
            again = cpu_build.build_library("hostile", source)
        assert len(seen) == 1 and again == lib and lib.stat().st_size == size
    # Loaded in a fresh process: a library this process mapped must not be rewritten under it.
    code = f"import ctypes; print(ctypes.CDLL({str(lib)!r}).answer())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "42", out.stderr


def test_ctrl_c_during_imports_is_one_line(tmp_path: Path) -> None:
    """SIGINT 0.3 s after start, while torch is still importing: exit 130, one line."""
    env = dict(os.environ, QUANTKIT_HOME=str(tmp_path / "home"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantkit.cli.main", "inspect", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    if proc.returncode != INTERRUPTED:  # finished before the signal landed: still one line
        assert len(err.strip().splitlines()) == 1, err
        return
    assert err.strip() == "interrupted; nothing was written"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_killed_writer_are_swept_and_nothing_is_lost(tmp_path: Path) -> None:
    from quantkit.paths import sweep_leftovers

    target = tmp_path / "ckpt"
    pid = _dead_pid()
    half = tmp_path / f".ckpt.tmp-{pid}-deadbeef"  # SIGKILL mid-write
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 1000)
    moved = tmp_path / f".ckpt.old-{pid}-cafef00d"  # SIGKILL between the two renames
    moved.mkdir()
    (moved / "config.json").write_text("{}")
    live = tmp_path / f".ckpt.tmp-{os.getpid()}-0badf00d"  # a writer still running: untouched
    live.mkdir()
    done = sweep_leftovers(target)
    assert not half.exists() and live.exists()
    assert (target / "config.json").read_text() == "{}" and not moved.exists()
    assert any("restored" in line for line in done) and any("removed" in line for line in done)


def test_ctrl_c_while_the_old_checkpoint_is_deleted_finishes_the_deletion(
    tmp_path: Path, monkeypatch
) -> None:
    import signal

    from quantkit import paths

    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    new = tmp_path / "new"
    new.mkdir()
    (new / "new.bin").write_bytes(b"new")
    removed = paths._remove

    def slow_remove(path: Path) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C mid-deletion
        removed(path)

    monkeypatch.setattr(paths, "_remove", slow_remove)
    monkeypatch.setattr(paths, "WRITTEN", [])
    with pytest.raises(KeyboardInterrupt):
        paths.replace_dir(new, target)
    assert (target / "new.bin").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no half-deleted .old- left
    assert paths.WRITTEN == [target]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--seed", str(2**70)], "--seed"),
        (["--regex", "a+", "--compile-timeout", "inf"], "--compile-timeout"),
        (["--regex", "a+", "--compile-timeout", "nan"], "--compile-timeout"),
        (["--regex", ""], "--regex: expected a non-empty value"),
        (["--schema", ""], "--schema: expected a non-empty value"),
    ],
    ids=["seed-past-64-bits", "timeout-inf", "timeout-nan", "regex-empty", "schema-empty"],
)
def test_options_that_used_to_slip_through(ckpt: Path, capsys, args: list[str], needle: str):
    code, out, err = run_cli(
        capsys, "generate", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2", *args
    )
    _check(code, err, USAGE, needle)
    assert out == ""  # nothing generated, constrained or not

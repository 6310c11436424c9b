"""Progress for the Triton interpreter path: `generate` says it is the interpreter and reports each
forward layer by layer (a forward of the embedded model takes minutes there).

The unit test checks the reporter on a tiny model's real forwards; the CLI test runs `quantkit
generate` with TRITON_INTERPRET=1 QUANTKIT_BACKEND=triton in a fresh process (the variable must
be set before Triton is imported) on a tiny INT4 checkpoint."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.runtime.layer_progress import layer_progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _tiny_model(layers: int = 3) -> torch.nn.Module:
    from quantkit.models.config import ModelConfig
    from quantkit.models.decoder import CausalLM

    cfg = ModelConfig.from_dict(
        {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 64, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "tie_word_embeddings": True}
    )  # fmt: skip
    return CausalLM(cfg).eval()


def test_each_forward_is_reported_layer_by_layer() -> None:
    model = _tiny_model(layers=3)
    stream = io.StringIO()  # not a terminal: a line when each forward ends
    with torch.inference_mode(), layer_progress(model, new_tokens=3, label="interp", stream=stream):
        for _ in range(3):  # the prefill gives token 1; each later call one more
            model(torch.tensor([[1, 2, 3]]))
    lines = stream.getvalue().splitlines()
    assert [ln.split(",")[0:2] for ln in lines] == [
        ["interp: prefill", " layer 3/3"],
        ["interp: token 2/3", " layer 3/3"],
        ["interp: token 3/3", " layer 3/3"],
    ], lines
    model(torch.tensor([[1, 2]]))  # the hooks are gone after the block
    assert stream.getvalue().splitlines() == lines


def test_on_a_terminal_one_line_is_redrawn_per_layer() -> None:
    model = _tiny_model(layers=2)
    stream = _Terminal()
    with torch.inference_mode(), layer_progress(model, new_tokens=1, label="interp", stream=stream):
        model(torch.tensor([[1, 2, 3]]))
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n"), repr(text)
    assert "layer 1/2" in text and "to go" in text and "layer 2/2" in text


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_generate_under_the_interpreter_says_so_and_shows_progress(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    ckpt = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", "auto")).save(
        tmp_path / "ckpt", source_dir=tiny_model_dir
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "QUANTKIT_BACKEND": "triton",
           "QUANTKIT_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.cli.main", "generate", str(ckpt), "--prompt", "hi",
         "--max-new-tokens", "2", "--temperature", "0", "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "under TRITON_INTERPRET=1" in proc.stderr
    ends = re.findall(r"triton interpreter: (prefill|token \d/2), layer 2/2", proc.stderr)
    assert ends == ["prefill", "token 2/2"], proc.stderr
    assert "kernel triton" in proc.stdout  # the summary names the kernel that ran

"""Per family: which decode step runs it (the one-call C step, or the PyTorch path with a
one-line reason), and the roofline's parameter count against the real model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from quantkit.format.scheme import QuantScheme
from quantkit.perf.roofline import ModelShape
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.generate import generate
from quantkit.runtime.loader import load_model
from quantkit.runtime.sampling import SamplingParams
from tests.family_models import FAMILIES, make_family_model

pytestmark = pytest.mark.usefixtures("one_thread")
# Families the C step runs (its layer: RMSNorm, q/k/v, rope, attention over the whole cache,
# o, RMSNorm, gate/up, SiLU, down). The tiny Mistral and Phi-3 set a sliding window, which the step
# does not implement, so it is checked without one.
C_STEP = {
    "llama3": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "phi3": {"sliding_window": None},
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_family_model(request.param, tmp_path_factory.mktemp("m"))


def test_roofline_counts_the_real_parameters(family_dir) -> None:
    name, path = family_dir
    shape = ModelShape.from_file(path)
    state = load_file(path / "model.safetensors")
    assert shape.n_params.total == sum(t.numel() for t in state.values()), name


def test_decode_step_is_the_c_one_or_says_why_not(family_dir, tmp_path: Path, monkeypatch) -> None:
    from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available

    name, path = family_dir
    if name in C_STEP and C_STEP[name]:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **C_STEP[name]}))
    outcome = quantize_model(path, scheme=QuantScheme("int4", 32))
    ckpt = outcome.save(tmp_path / "ckpt", source_dir=path)
    model = load_model(ckpt, tokenizer=False).model
    model.setup_cache(batch=1, max_len=48)
    reason = model.decode_path.reason
    model.drop_cache()
    if name not in C_STEP:
        assert reason.startswith(f"family {name}: PyTorch path: the C step has no "), reason
        return
    if not cpu_kernel_available():
        pytest.fail("gcc is needed for the C kernel")
    assert reason == "bound", (name, reason)
    params = SamplingParams(max_new_tokens=12)
    fast = generate(model, [[5, 17, 99, 3, 7, 8, 9, 10, 11, 12]], params).tokens
    monkeypatch.setenv("QUANTKIT_CPU_DECODE", "0")
    assert generate(model, [[5, 17, 99, 3, 7, 8, 9, 10, 11, 12]], params).tokens == fast

"""Per family: which decode step runs it (the one-call C step, or the PyTorch path with a
one-line reason), and the roofline's parameter count against the real model's."""

from __future__ import annotations

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
# Families the C step runs: every dense one, with their sliding windows (shorter than the
# prompts here), soft-caps, sandwich norms, GELU gates and per-head q/k norms.
C_STEP = FAMILIES


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

"""Every supported family through `quantize_model` with AWQ, RTN and GPTQ INT4 and FP8: the
checkpoint (compressed-tensors, the family's own module names) loads with transformers and
computes quantkit's logits, and the calibrated methods beat round-to-nearest layer by layer on
real text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.format.scheme import QuantScheme
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.pipeline import QuantizeOutcome, quantize_model
from tests.conftest import make_tokenizer
from tests.family_models import FAMILIES, make_family_model, max_rel_err, padded_batch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
# transformers dequantizes the stored tensors to the same fp32 weights quantkit computes with;
# what is left is kernel-order rounding (measured <= 2e-6) and W8A8's activation rounding.
INTEROP_REL_ERR = 1e-3
METHODS = {
    "awq": ("awq", QuantScheme("int4", 32)),
    "rtn": ("rtn", QuantScheme("int4", 32)),
    "gptq": ("gptq", QuantScheme("int4", 32)),
    "fp8": ("rtn", QuantScheme("fp8")),
}
AWQ = AwqConfig(grid=10, search_tokens=256, clip_tokens=64, batch_sequences=8)


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> tuple[str, Path, torch.Tensor]:
    """(family, model directory with a BPE tokenizer trained on English, calibration ids
    [8, 32] of a Wikipedia article)."""
    from tokenizers import Tokenizer

    path = make_family_model(request.param, tmp_path_factory.mktemp(request.param))
    make_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode(_article()).ids
    return request.param, path, torch.tensor(ids[: 8 * 32]).view(8, 32)


def _article() -> str:
    """The first English Wikipedia article quantkit calibrates on (bundled with gensim)."""
    from quantkit.quantize.calibration import wiki_articles

    return wiki_articles()[0]


def _quantize(path: Path, method: str, samples: torch.Tensor) -> QuantizeOutcome:
    algorithm, scheme = METHODS[method]
    return quantize_model(
        path, scheme=scheme, algorithm=algorithm, samples=lambda: samples, awq=AWQ,
        gptq=GptqConfig(),
    )  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
def test_checkpoint_loads_in_transformers_with_quantkits_logits(
    family_dir, method: str, tmp_path: Path
) -> None:
    from transformers import CompressedTensorsConfig

    name, path, samples = family_dir
    outcome = _quantize(path, method, samples)
    ckpt = outcome.save(tmp_path / "ckpt", source_dir=path)
    config = json.loads((ckpt / "config.json").read_text())
    layer0 = [m for m in outcome.quantized_modules if m.startswith("model.layers.0.")]
    assert [m.removeprefix("model.layers.0.") for m in layer0] == list(
        outcome.runtime_model().family.linears
    )
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        got = outcome.runtime_model()(ids)
    for row, n in enumerate(mask.sum(1).tolist()):
        assert max_rel_err(got[row, :n], want[row, :n]) <= INTEROP_REL_ERR, (name, method, row)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_methods_beat_rtn_per_layer(family_dir, method: str) -> None:
    """Each layer's error (AWQ: the layer output's MSE; GPTQ: the Hessian-weighted output
    error of its Linears) is below round-to-nearest's on the same calibration tokens."""
    name, path, samples = family_dir
    reports = _quantize(path, method, samples).layer_reports
    assert reports
    for r in reports:
        assert r.method_error < r.rtn_error, (name, method, r.index, r.method_error, r.rtn_error)

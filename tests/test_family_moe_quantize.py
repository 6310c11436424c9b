"""The mixture-of-experts families through `quantize_model`: every expert's Linears quantized
under the hub's per-expert names (the router dense), AWQ and GPTQ calibrated per expert on its
routed tokens and below round-to-nearest layer by layer, the report's per-expert token counts,
and an expert no token reaches rounded to nearest (not skipped, not NaN).

transformers 5.24 loads these checkpoints by merging the per-expert tensors into its fused 3-D
expert parameters, dequantizing each expert on the way (`CompressedTensorsDequantize`). That
works for FP8 and symmetric INT4, whose logits are checked against quantkit's; for asymmetric
INT4 its per-expert dequantizer drops `weight_zero_point` and fails ("Asymmetric quant requires
zero-point values"), so those checkpoints are checked against quantkit's own dequantized dense
model, and a test pins the failure so that a transformers fix shows up here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.format.checkpoint import dequantize_checkpoint_tensors, load_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import build_model
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.pipeline import QuantizeOutcome, quantize_model
from quantkit.runtime.loader import load_model
from tests.conftest import make_tokenizer, run_cli
from tests.family_models import MOE_FAMILIES, make_family_model, max_rel_err, padded_batch
from tests.test_family_quantize import _article

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
REL_ERR = 1e-3  # as the dense families: same fp32 weights, kernel-order rounding left
AWQ = AwqConfig(grid=10, search_tokens=256, clip_tokens=64, batch_sequences=8)
INT4, INT4_SYM = QuantScheme("int4", 32), QuantScheme("int4", 32, symmetric=True)
# method -> (algorithm, scheme, transformers loads it)
METHODS = {
    "awq": ("awq", INT4, False),
    "rtn": ("rtn", INT4, False),
    "gptq": ("gptq", INT4, False),
    "fp8": ("rtn", QuantScheme("fp8"), True),
    "awq-sym": ("awq", INT4_SYM, True),
    "gptq-sym": ("gptq", INT4_SYM, True),
}


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_dir(request, tmp_path_factory) -> tuple[str, Path, torch.Tensor]:
    """(family, model directory with a BPE tokenizer, calibration ids [8, 32] of Wikipedia)."""
    from tokenizers import Tokenizer

    path = make_family_model(request.param, tmp_path_factory.mktemp(request.param))
    make_tokenizer(path)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(_article()).ids
    return request.param, path, torch.tensor(ids[: 8 * 32]).view(8, 32)


def _quantize(path: Path, method: str, samples: torch.Tensor, **kw) -> QuantizeOutcome:
    algorithm, scheme, _ = METHODS[method]
    return quantize_model(
        path, scheme=scheme, algorithm=algorithm, samples=lambda: samples, awq=AWQ,
        gptq=GptqConfig(), **kw,
    )  # fmt: skip


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("method", METHODS)
def test_checkpoint_computes_quantkits_logits(moe_dir, method: str, tmp_path: Path) -> None:
    """Hub names per expert, router dense; transformers (where it can) or quantkit's own
    dequantized dense model of the checkpoint computes the loaded runtime model's logits."""
    name, path, samples = moe_dir
    outcome = _quantize(path, method, samples)
    ckpt = outcome.save(tmp_path / "ckpt", source_dir=path)
    moe = outcome.runtime_model().family.moe
    block = f"model.layers.1.{moe.block}"
    assert f"{block}.experts.3.{moe.down}" in outcome.quantized_modules
    assert f"{block}.{moe.router}.weight" in outcome.tensors  # dense
    assert not any(m.endswith(f".{moe.router}") for m in outcome.quantized_modules)
    ids, mask = padded_batch()
    got = _logits(load_model(ckpt, tokenizer=False).model, ids)
    if METHODS[method][2]:
        from transformers import CompressedTensorsConfig

        want = (
            transformers.AutoModelForCausalLM.from_pretrained(
                ckpt,
                dtype=torch.float32,
                quantization_config=CompressedTensorsConfig(dequantize=True),
            )
            .eval()(ids, attention_mask=mask)
            .logits.detach()
        )
    else:
        loaded = load_checkpoint(ckpt)
        dense = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)
        want = _logits(build_model(loaded.config, dense), ids)
    for row, n in enumerate(mask.sum(1).tolist()):
        assert max_rel_err(got[row, :n], want[row, :n]) <= REL_ERR, (name, method, row)


def test_transformers_cannot_load_asymmetric_int4_experts(moe_dir, tmp_path: Path) -> None:
    from transformers import CompressedTensorsConfig

    name, path, samples = moe_dir
    ckpt = _quantize(path, "rtn", samples).save(tmp_path / "ckpt", source_dir=path)
    with pytest.raises(Exception, match="conversion of the weights"):
        transformers.AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
        )


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_methods_beat_rtn_per_layer_and_count_tokens(moe_dir, method: str) -> None:
    name, path, samples = moe_dir
    outcome = _quantize(path, method, samples)
    for r in outcome.layer_reports:
        assert r.method_error < r.rtn_error, (name, method, r.index, r.method_error, r.rtn_error)
        # 256 tokens, 2 experts each: 512 routed token slots over 4 experts.
        assert len(r.expert_tokens) == 4 and sum(r.expert_tokens) == 2 * samples.numel()
    layers = outcome.experts_report()["moe_calibration"]
    assert [entry["layer"] for entry in layers] == [0, 1]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_an_expert_no_token_reaches_is_rounded_to_nearest(
    moe_dir, method: str, tmp_path: Path, capsys
) -> None:
    """The router is made to never pick expert 3: it gets no calibration token, is reported,
    and its down projection holds exactly round-to-nearest's tensors; nothing is NaN."""
    name, path, samples = moe_dir
    originals: dict[str, torch.Tensor] = {}

    def starve_expert_3(model) -> None:
        moe = model.family.moe
        for i, layer in enumerate(model.model.layers):
            block = layer.get_submodule(moe.block)
            router = block.get_submodule(moe.router)
            router.register_forward_hook(
                lambda _m, _a, out: out.index_fill(-1, torch.tensor([3]), -1e9)
            )
            down = f"model.layers.{i}.{moe.expert(3, 'down')}"
            originals[down] = model.get_submodule(down).weight.detach().clone()

    outcome = _quantize(path, method, samples, on_loaded=starve_expert_3)
    for r in outcome.layer_reports:
        assert r.expert_tokens[3] == 0 and r.rtn_experts == [3], (name, r.expert_tokens)
        assert min(r.expert_tokens[:3]) > 0
    assert all(e["rtn_fallback"] == [3] for e in outcome.experts_report()["moe_calibration"])
    scheme = outcome.scheme
    for down, w in originals.items():
        want = scheme.format.store(scheme.format.round_to_nearest(w, scheme), scheme, dtype=w.dtype)
        for suffix, t in want.items():
            assert torch.equal(outcome.tensors[f"{down}.{suffix}"], t), (down, suffix)
    dense = outcome.dense_state()
    assert all(torch.isfinite(t).all() for t in dense.values() if t.is_floating_point())
    saved = outcome.save(tmp_path / "ckpt", source_dir=path)
    report = json.loads((saved / "quantkit.json").read_text())["report"]
    assert report["moe_calibration"][0]["rtn_fallback"] == [3]
    code, out, _ = run_cli(capsys, "inspect", str(saved))
    assert code == 0 and "cpu decode   PyTorch path" not in out  # the C step runs it

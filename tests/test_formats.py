"""The weight-format registry: a format is one `WeightFormat` plus one entry in `FORMATS`.

The proof is a toy format, `toy8`: INT8 per output channel (W8A16, compressed-tensors `int`,
`naive-quantized`), defined here and nowhere else: registered, it goes through the scheme, the
compressed-tensors config both ways, RTN quantization, the checkpoint writer and loader, the
dense oracle and QuantLinear's buffers without another line changing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format import formats
from quantkit.format.checkpoint import (
    dequantize_checkpoint_tensors,
    load_checkpoint,
    save_checkpoint,
)
from quantkit.format.compressed_tensors import (
    scheme_from_quantization_config,
    scheme_to_quantization_config,
)
from quantkit.format.dtypes import SCALE_DTYPES
from quantkit.format.scheme import QuantScheme
from quantkit.format.weight_format import Codes, Tensors, WeightFormat, check_tensor, expect
from quantkit.quantize.algorithms import algorithm_for
from quantkit.runtime.quant_linear import QuantLinear


class Int8Format(WeightFormat):
    kind = "toy8"  # the real int8 (W8A8, `format/int8.py`) is registered; this one is not
    bits = 8
    ct_type = "int"
    ct_formats = ("naive-quantized",)

    def normalized(self, scheme: QuantScheme) -> dict[str, Any]:
        if scheme.activations != "none":
            raise SchemeError(f"activations: expected 'none' for int8, got {scheme.activations!r}")
        return {"group_size": -1, "symmetric": True}

    def describe(self, scheme: QuantScheme, algorithm: str | None) -> str:
        return "int8 per-channel"

    def config_entries(self, scheme: QuantScheme) -> tuple[dict[str, Any], dict[str, Any] | None]:
        weights = {"num_bits": 8, "type": "int", "strategy": "channel", "group_size": None}
        return {**weights, "symmetric": True, "dynamic": False}, None

    def scheme_fields(
        self, weights: Mapping[str, Any], *, fmt: Any, acts: Any, where: str
    ) -> dict[str, Any]:
        expect(weights, "num_bits", (8,), where=f"{where}.weights")
        return {"kind": "toy8"}

    def tensor_names(self, scheme: QuantScheme) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def marks_quantized(self, local: str, tensor: torch.Tensor) -> bool:
        return local == "weight_scale" or (local == "weight" and tensor.dtype == torch.int8)

    def check(
        self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, name: Callable[[str], str]
    ) -> tuple[int, int]:
        n, k = tensors["weight"].shape
        check_tensor(name("weight"), tensors["weight"], (n, k), (torch.int8,))
        check_tensor(name("weight_scale"), tensors["weight_scale"], (n, 1), SCALE_DTYPES)
        return n, k

    def shape(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        n, k = tensors["weight"].shape
        return n, k

    def empty(
        self, n: int, k: int, scheme: QuantScheme, *, dtype: torch.dtype, device: Any
    ) -> dict[str, torch.Tensor | None]:
        return {
            "weight": torch.empty(n, k, dtype=torch.int8, device=device),
            "weight_scale": torch.empty(n, 1, dtype=dtype, device=device),
        }

    def round_to_nearest(self, weight: torch.Tensor, scheme: QuantScheme) -> Codes:
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / 127
        return Codes(torch.round(weight.float() / scale).to(torch.int8), scale, None)

    def pack(self, q: Codes, scheme: QuantScheme, *, dtype: torch.dtype) -> Tensors:
        return {"weight": q.codes.contiguous(), "weight_scale": q.scale.to(dtype).contiguous()}

    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, *, dtype: torch.dtype
    ) -> torch.Tensor:
        return (tensors["weight"].float() * tensors["weight_scale"].float()).to(dtype)


@pytest.fixture
def int8(monkeypatch: pytest.MonkeyPatch) -> WeightFormat:
    """The one registry line a new format adds."""
    fmt = Int8Format()
    monkeypatch.setitem(formats.FORMATS, fmt.kind, fmt)
    return fmt


def test_registered_formats() -> None:
    assert list(formats.FORMATS) == ["int4", "fp8", "int8", "nvfp4", "mxfp4"]
    with pytest.raises(
        SchemeError, match="kind: expected one of int4, fp8, int8, nvfp4, mxfp4, got 'int2'"
    ):
        QuantScheme("int2")


def test_a_new_format_is_one_class_and_one_registry_line(int8: WeightFormat, tmp_path: Path):
    scheme = QuantScheme("toy8")
    assert (scheme.group_size, scheme.symmetric, scheme.bits) == (-1, True, 8)
    assert scheme.describe() == "int8 per-channel"

    # compressed-tensors config, both ways: the int4 format does not claim 8-bit ints.
    cfg = scheme_to_quantization_config(scheme)
    assert cfg["format"] == "naive-quantized"
    assert scheme_from_quantization_config(cfg) == scheme
    # RTN is the algorithm every format gets, and the default for one without a listed default.
    assert algorithm_for(None, scheme).name == "rtn"

    torch.manual_seed(0)
    w = torch.randn(16, 32)
    layer = QuantLinear.from_float(w, scheme=scheme, dtype=torch.float32)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (16, 1)
    state = {f"model.layers.0.mlp.down_proj.{k}": v for k, v in layer.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.randn(8, 32)
    source = tmp_path / "src"
    source.mkdir()
    out = save_checkpoint(
        tmp_path / "ckpt",
        tensors=state,
        config={"model_type": "llama"},
        scheme=scheme,
        quantized_modules=["model.layers.0.mlp.down_proj"],
        source_dir=source,
        algorithm="rtn",
        report={},
    )
    loaded = load_checkpoint(out)
    assert loaded.scheme == scheme
    assert loaded.quantized_modules == ["model.layers.0.mlp.down_proj"]
    dense = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)[
        "model.layers.0.mlp.down_proj.weight"
    ]
    # Per-channel int8: at most half a step (absmax / 127 / 2) from the original weight.
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((dense - w).abs() <= step / 2 + 1e-6).all()


def test_a_new_format_is_validated_by_its_own_contract(int8: WeightFormat) -> None:
    scheme = QuantScheme("toy8")
    bad = {"weight": torch.zeros(4, 8, dtype=torch.int16), "weight_scale": torch.ones(4, 1)}
    with pytest.raises(CheckpointError, match=r"tensor weight: expected dtype int8, got int16"):
        QuantLinear.from_tensors(bad, scheme=scheme)


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme("int4", 32),
        QuantScheme("int4", 64, symmetric=True),
        QuantScheme("int4", -1),
        QuantScheme("fp8"),
    ],  # fmt: skip
    ids=["int4-g32", "int4-g64-sym", "int4-channel", "fp8"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_and_store_in_row_blocks_is_the_whole_store(scheme, dtype) -> None:
    """Rounding a Linear a block of rows at a time (to bound the fp32 temporaries) gives the
    very tensors of rounding it whole, blocks that divide no packing unit included."""
    w = torch.randn(37, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    fmt = scheme.format
    whole = fmt.store(fmt.round_to_nearest(w, scheme), scheme, dtype=dtype)
    for rows in (1, 5, 8, 36, 37, 4096):
        blocks = fmt.round_and_store(w, scheme, dtype=dtype, rows=rows)
        assert blocks.keys() == whole.keys()
        for name, t in whole.items():
            assert t.dtype == blocks[name].dtype and torch.equal(t, blocks[name]), (rows, name)

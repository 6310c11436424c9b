"""NVFP4: E2M1 codes in groups of 16 with float8 E4M3 group scales under one fp32 global scale per
tensor: compressed-tensors `nvfp4-pack-quantized` (preset NVFP4A16; NVFP4 with activations).

One quantized Linear W [N, K] stores `weight_packed` uint8 [N, K/2] (`quantkit.format.fp4`),
`weight_scale` float8_e4m3fn [N, K/16] and `weight_global_scale` float32 [1]; W4A4 adds
`input_global_scale` float32 [1]. The global scale is a multiplier into the E4M3 range, as
compressed-tensors and vLLM hold it: W = value(code) * (weight_scale / weight_global_scale),
the quotient in fp32.

The math, as compressed-tensors computes it (so its own compressor writes the same bytes):

- global scale g = 448 * 6 / absmax(W) in fp32, as torch evaluates a number over a tensor
  (2688 times the fp32 reciprocal); an all-zero tensor: 1;
- group scale s = E4M3(g * fp32(absmax(group) / 6)), saturating at 448 (round to nearest even);
  a group whose s is 0 gets 0.125 (compressed-tensors' stand-in: its codes are 0 anyway);
- codes = E2M1(W / fp32(s / g)).

Linears that vLLM runs as one matmul (q/k/v, gate/up) must share g, since vLLM keeps one per
fused layer: `round_and_store_group` rounds them on the largest absmax of the group, as
llm-compressor does.

W4A4 (`activations="dynamic"`): at run time each group of 16 activations along K is quantized
the same way on the stored `input_global_scale` (a calibrated constant, compressed-tensors'
`dynamic: "local"`), which `nvfp4_fake_quantize` emulates. quantkit reads and runs such
checkpoints; writing one needs calibrated input ranges, which `quantkit quantize` does not
collect (`dynamic_activations` is False: `--activations dynamic` is refused there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.fp4 import (
    E2M1_MAX,
    Fp4Format,
    e2m1_codes,
    fp4_dequantize,
    grouped,
    pack_fp4,
    unpack_fp4,
)
from quantkit.format.weight_format import (
    Codes,
    SchemeView,
    Tensors,
    check_tensor,
    expect,
)

GROUP = 16
E4M3_MAX = 448.0
ZERO_GROUP_SCALE = 0.125  # compressed-tensors' group scale where the rounded one is 0
_GLOBALS = ("weight_global_scale", "input_global_scale")
_LOCAL_NAMES = frozenset({"weight_packed", "weight_scale", *_GLOBALS})

WEIGHTS: dict[str, Any] = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": GROUP,
    "strategy": "tensor_group",
    "dynamic": False,
    "scale_dtype": "torch.float8_e4m3fn",
}
# The NVFP4 preset's activations: local (group) scales at run time, the global one static.
INPUT_ACTIVATIONS: dict[str, Any] = {
    **WEIGHTS,
    "dynamic": "local",
    "observer": "static_minmax",
}


def nvfp4_global_scale(absmax: torch.Tensor | float) -> torch.Tensor:
    """float32 [1] = 448 * 6 / absmax (1 for an absmax of 0, or one too small to divide), as
    compressed-tensors' `generate_gparam` computes it (torch: 2688 * fp32(1 / absmax))."""
    a = torch.as_tensor(absmax, dtype=torch.float32).reshape(1)
    g = (E4M3_MAX * E2M1_MAX) / a.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)


def nvfp4_group_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K/16], every value exact in E4M3: each group's scale (module docstring)."""
    g = global_scale.float().reshape(())
    absmax = grouped(x.float(), GROUP).abs().amax(dim=-1)
    s = (g * (absmax / E2M1_MAX)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(s == 0, torch.full_like(s, ZERO_GROUP_SCALE), s)


def nvfp4_effective_scale(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 scale / global scale: what a code's value is multiplied by."""
    return scale.float() / global_scale.float().reshape(())


def nvfp4_quantize(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] on global scale g -> (uint8 codes [..., K], fp32 group scales [..., K/16])."""
    scale = nvfp4_group_scales(x, global_scale)
    quotient = grouped(x.float(), GROUP) / nvfp4_effective_scale(scale, global_scale).unsqueeze(-1)
    return e2m1_codes(quotient).reshape(x.shape), scale


def nvfp4_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """fp32 [..., K] = value(code) * fp32(scale / global scale)."""
    return fp4_dequantize(codes, nvfp4_effective_scale(scale, global_scale), GROUP)


def nvfp4_fake_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """W4A4's activation rounding, emulated: x [..., K] quantized per group of 16 along K on
    `global_scale` (the stored `input_global_scale`) and dequantized, in fp32."""
    codes, scale = nvfp4_quantize(x, global_scale)
    return nvfp4_dequantize(codes, scale, global_scale)


class Nvfp4Format(Fp4Format):
    kind = "nvfp4"
    group = GROUP
    scale_dtype = torch.float8_e4m3fn
    dynamic_activations = False  # W4A4 runs, but quantize cannot calibrate its input scale
    fixed_dtypes = _GLOBALS
    ct_formats = ("nvfp4-pack-quantized",)

    def normalized(self, scheme: SchemeView) -> dict[str, Any]:
        return {"group_size": self._group_size(scheme), "symmetric": True}

    def describe(self, scheme: SchemeView, algorithm: str | None) -> str:
        act = "W4A4 dynamic" if scheme.activations == "dynamic" else "W4A16"
        return f"nvfp4 e2m1 g16 ({act}{f', {algorithm}' if algorithm else ''})"

    # ---------------------------------------------------------------- compressed-tensors

    def config_entries(self, scheme: SchemeView) -> tuple[dict[str, Any], dict[str, Any] | None]:
        acts = dict(INPUT_ACTIVATIONS) if scheme.activations == "dynamic" else None
        return dict(WEIGHTS), acts

    def scheme_fields(
        self, weights: Mapping[str, Any], *, fmt: Any, acts: Any, where: str
    ) -> dict[str, Any]:
        if fmt not in self.ct_formats:
            raise CheckpointError(
                f"quantization_config.{where}.format: expected {self.ct_formats[0]!r} for "
                f"tensor_group float weights, got {fmt!r}"
            )
        _expect_entry(weights, where=f"{where}.weights", dynamic=False)
        if acts is None:
            return {"kind": self.kind, "activations": "none"}
        if not isinstance(acts, Mapping):
            raise CheckpointError(
                f"quantization_config.{where}.input_activations: expected null or a dict, "
                f"got {acts!r}"
            )
        _expect_entry(acts, where=f"{where}.input_activations", dynamic="local")
        return {"kind": self.kind, "activations": "dynamic"}

    # ---------------------------------------------------------------- tensor contract

    def tensor_names(self, scheme: SchemeView) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale", "weight_global_scale")
        return (*names, "input_global_scale") if scheme.activations == "dynamic" else names

    def marks_quantized(self, local: str, tensor: torch.Tensor) -> bool:
        return local in _LOCAL_NAMES

    def check(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, name: Callable[[str], str]
    ) -> tuple[int, int]:
        n, k = self._packed_shape(tensors, name)
        if bool(torch.isnan(tensors["weight_scale"].float()).any()):
            raise CheckpointError(f"tensor {name('weight_scale')}: expected no NaN, got NaN")
        for local in self.tensor_names(scheme)[2:]:
            t = tensors[local]
            check_tensor(name(local), t, (1,), (torch.float32,))
            if not (bool(torch.isfinite(t).all()) and float(t) > 0):
                raise CheckpointError(
                    f"tensor {name(local)}: expected a finite global scale > 0, got {float(t)}"
                )
        return n, k

    def empty(
        self, n: int, k: int, scheme: SchemeView, *, dtype: torch.dtype, device: Any
    ) -> dict[str, torch.Tensor | None]:
        out = self._empty(n, k, device)
        out["weight_global_scale"] = torch.ones(1, dtype=torch.float32, device=device)
        out["input_global_scale"] = None
        if scheme.activations == "dynamic":
            out["input_global_scale"] = torch.ones(1, dtype=torch.float32, device=device)
        return out

    # ---------------------------------------------------------------- the math

    def round_to_nearest(self, weight: torch.Tensor, scheme: SchemeView) -> Codes:
        g = nvfp4_global_scale(weight.float().abs().amax())
        return Codes(*nvfp4_quantize(weight, g), None, g)

    def pack(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Tensors:
        if q.zero is not None or q.global_scale is None:
            raise SchemeError(
                "codes: expected no zero point and a global scale for nvfp4, got "
                f"{'zero points' if q.zero is not None else 'no global scale'}"
            )
        if scheme.activations == "dynamic":
            raise SchemeError(
                "activations: nvfp4 W4A4 stores a calibrated input_global_scale, which weights "
                "alone cannot give; expected 'none' (W4A16), got 'dynamic'"
            )
        scale8 = q.scale.float().to(torch.float8_e4m3fn)
        if not torch.equal(scale8.float(), q.scale.float()):
            raise SchemeError("scale: expected values exact in float8_e4m3fn, got others")
        return {
            "weight_packed": pack_fp4(q.codes),
            "weight_scale": scale8.contiguous(),
            "weight_global_scale": q.global_scale.float().reshape(1).clone(),
        }

    def round_and_store(
        self, weight: torch.Tensor, scheme: SchemeView, *, dtype: torch.dtype, rows: int = 1024
    ) -> Tensors:
        return self.round_and_store_group([weight], scheme, dtype=dtype, rows=rows)[0]

    def round_and_store_group(
        self,
        weights: Sequence[torch.Tensor],
        scheme: SchemeView,
        *,
        dtype: torch.dtype,
        rows: int = 1024,
    ) -> list[Tensors]:
        """One global scale for all of `weights` (the largest absmax), then each weight's rows in
        blocks of `rows` (the global scale is the whole tensor's, never a block's)."""
        g = nvfp4_global_scale(torch.stack([w.float().abs().amax() for w in weights]).amax())
        out = []
        for w in weights:
            blocks = [nvfp4_quantize(w[i : i + rows], g) for i in range(0, w.shape[0], rows)]
            codes = torch.cat([b[0] for b in blocks])
            scale = torch.cat([b[1] for b in blocks])
            out.append(self.pack(Codes(codes, scale, None, g), scheme, dtype=dtype))
        return out

    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, *, dtype: torch.dtype
    ) -> torch.Tensor:
        codes = unpack_fp4(tensors["weight_packed"])
        w = nvfp4_dequantize(codes, tensors["weight_scale"], tensors["weight_global_scale"])
        return w.to(dtype)


def _expect_entry(entry: Mapping[str, Any], *, where: str, dynamic: Any) -> None:
    """The fields of an NVFP4 `weights` / `input_activations` entry quantkit relies on."""
    expect(entry, "num_bits", (4,), where=where)
    expect(entry, "type", ("float",), where=where)
    expect(entry, "strategy", ("tensor_group",), where=where)
    expect(entry, "group_size", (GROUP,), where=where)
    expect(entry, "symmetric", (True,), where=where)
    expect(entry, "dynamic", (dynamic,), where=where)
    # Written by recent compressed-tensors; older configs leave it out (the same default).
    expect(entry, "scale_dtype", (None, "torch.float8_e4m3fn"), where=where)


NVFP4 = Nvfp4Format()

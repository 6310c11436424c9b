"""`WeightFormat`: everything one stored weight format is, in one object.

A format (INT4 `pack-quantized`, FP8 `float-quantized`, ...) is one module that subclasses this
and one line in `quantkit.format.formats`. The rest of quantkit asks the format instead of
branching on `scheme.kind`:

- the scheme: which `QuantScheme` fields it allows and how it reads as one line;
- compressed-tensors: its `weights` / `input_activations` entries in config.json, both ways;
- the tensor contract: the local tensor names, shapes and dtypes of one quantized Linear (the
  checkpoint writer, the loader and `QuantLinear` all read it from here);
- the math: round-to-nearest, packing codes into those tensors, and dequantizing them back.

What a format needs from the layers above is registered there, not here: the kernels that run it
(`quantkit.fused_kernels.kernel_registry`) and the algorithms that can produce it
(`quantkit.quantize.algorithms`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from quantkit.errors import CheckpointError

Tensors = dict[str, torch.Tensor]


class SchemeView(Protocol):
    """What a format reads of a `QuantScheme`. The formats sit below the scheme that names them
    (`QuantScheme` looks its format up in `formats`), so they take this shape, not the class."""

    kind: str
    group_size: Any  # an int, or "auto" before `QuantScheme.resolve`
    symmetric: bool
    activations: str

    def group_size_for(self, in_features: int) -> int: ...

    def groups(self, in_features: int) -> int: ...

    def describe(self, algorithm: str | None = None) -> str: ...


class Codes(NamedTuple):
    """A quantizer's result for one Linear, before packing: the format's codes, fp32 scales,
    (for formats with them) zero points and a per-tensor global scale (NVFP4)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    # One value for the whole tensor, so a format with one rounds whole tensors (or groups of
    # them: `round_and_store_group`), never blocks of rows.
    global_scale: torch.Tensor | None = None


class WeightFormat(ABC):
    """One stored weight format. Subclasses set the class attributes and implement the methods;
    instances hold no state."""

    kind: str  # QuantScheme.kind
    bits: int
    # Codes share a scale per group of input channels, so a group size and the choice of zero
    # points apply (`--group-size`, `--symmetric`).
    grouped: bool
    # Activations can be quantized at run time too (`--activations dynamic`: W8A8).
    dynamic_activations: bool
    # The CPU's one-call decode step (fused_kernels/cpu/decode) runs layers of this format, and
    # Linears that share an input can be stored as one by stacking their rows (runtime.fusion).
    c_step: bool
    ct_type: str  # compressed-tensors `weights.type`
    ct_formats: tuple[str, ...]  # config `format` names read; the first is written
    # `--bits N` names this format (one format per width does: 8 is fp8); False: it is named
    # with `--format` only (int8).
    named_by_bits: bool = True
    # Float tensors whose dtype is the format's, not the model's (NVFP4's fp32 global scales):
    # `QuantLinear.to(dtype)` / `.half()` leave them, as they leave every float8 tensor.
    fixed_dtypes: tuple[str, ...] = ()
    # The one group size the format defines (FP4: 16 or 32); 0 = the user's choice.
    fixed_group: int = 0

    # ---------------------------------------------------------------- the scheme

    @abstractmethod
    def normalized(self, scheme: SchemeView) -> dict[str, Any]:
        """The scheme's fields after checking them for this format (SchemeError naming the
        field otherwise); fields the format fixes are set, so equal schemes compare equal."""

    @abstractmethod
    def describe(self, scheme: SchemeView, algorithm: str | None) -> str:
        """One human line, e.g. 'awq int4 g64 asymmetric'."""

    # ---------------------------------------------------------------- compressed-tensors

    @abstractmethod
    def config_entries(self, scheme: SchemeView) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(`weights`, `input_activations`) of the config group, as compressed-tensors writes
        them."""

    @abstractmethod
    def scheme_fields(
        self, weights: Mapping[str, Any], *, fmt: Any, acts: Any, where: str
    ) -> dict[str, Any]:
        """The QuantScheme fields a config group describes; anything this format cannot run is
        a CheckpointError naming the field."""

    # ---------------------------------------------------------------- tensor contract

    @abstractmethod
    def tensor_names(self, scheme: SchemeView) -> tuple[str, ...]:
        """The local names one quantized Linear stores (bias apart); the first one alone marks
        a module as quantized in error messages."""

    @abstractmethod
    def marks_quantized(self, local: str, tensor: torch.Tensor) -> bool:
        """Whether a tensor with this local name and value can only belong to a quantized
        module of this format (how the loader finds the quantized modules)."""

    @abstractmethod
    def check(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, name: Callable[[str], str]
    ) -> tuple[int, int]:
        """Validate shapes and dtypes of present tensors; return (N, K). `name(local)` gives the
        full tensor name for messages."""

    @abstractmethod
    def shape(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """(N, K) of tensors already validated."""

    @abstractmethod
    def empty(
        self, n: int, k: int, scheme: SchemeView, *, dtype: torch.dtype, device: Any
    ) -> dict[str, torch.Tensor | None]:
        """Uninitialised tensors of the contract for an [N, K] Linear, scales in `dtype`
        (None for a tensor the scheme leaves out, e.g. zero points when symmetric)."""

    # ---------------------------------------------------------------- the math

    @abstractmethod
    def round_to_nearest(self, weight: torch.Tensor, scheme: SchemeView) -> Codes:
        """Plain round-to-nearest codes of a dense weight [N, K]."""

    @abstractmethod
    def pack(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Tensors:
        """The tensors of the contract for codes as given, scales stored in `dtype`."""

    def store(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Tensors:
        """The tensors a quantizer writes: `pack`, after whatever fix-up storing the scales in
        `dtype` calls for (`stored_codes`)."""
        return self.pack(self.stored_codes(q, scheme, dtype=dtype), scheme, dtype=dtype)

    def stored_codes(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Codes:
        """The codes and scales as the checkpoint will hold them, scales stored in `dtype`
        (by default the codes as given). Row by row, like `round_to_nearest`."""
        return q

    def round_and_store(
        self, weight: torch.Tensor, scheme: SchemeView, *, dtype: torch.dtype, rows: int = 1024
    ) -> Tensors:
        """`store(round_to_nearest(weight))`, `rows` output rows at a time: every format's
        rounding and fix-up treat each row on its own (its scales are per row or per group of
        a row), so the tensors are the same while the fp32 temporaries are one block's, not
        the whole Linear's (a 128k-row head, the widest Linears of an 8B model)."""
        blocks = [
            self.stored_codes(
                self.round_to_nearest(weight[i : i + rows], scheme), scheme, dtype=dtype
            )
            for i in range(0, weight.shape[0], rows)
        ]
        if len(blocks) == 1:
            return self.pack(blocks[0], scheme, dtype=dtype)
        zeros = [b.zero for b in blocks]
        joined = Codes(
            torch.cat([b.codes for b in blocks]),
            torch.cat([b.scale for b in blocks]),
            None if zeros[0] is None else torch.cat(zeros),  # type: ignore[arg-type]
        )
        return self.pack(joined, scheme, dtype=dtype)

    def round_and_store_group(
        self,
        weights: Sequence[torch.Tensor],
        scheme: SchemeView,
        *,
        dtype: torch.dtype,
        rows: int = 1024,
    ) -> list[Tensors]:
        """`round_and_store` of Linears that read the same input (q/k/v, gate/up), which
        engines such as vLLM run as one matmul: each on its own here; a format with a
        per-tensor scale gives them one (NVFP4's global scale), as those engines require."""
        return [self.round_and_store(w, scheme, dtype=dtype, rows=rows) for w in weights]

    @abstractmethod
    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, *, dtype: torch.dtype
    ) -> torch.Tensor:
        """The dense weight [N, K] in `dtype` from the contract's tensors."""


def check_tensor(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    """A CheckpointError naming the tensor unless it has exactly `shape` and one of `dtypes`."""
    if tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise CheckpointError(
            f"tensor {name}: expected dtype {wanted}, got {str(t.dtype).removeprefix('torch.')}"
        )


def expect(cfg: Mapping[str, Any], key: str, allowed: tuple[Any, ...], *, where: str = "") -> Any:
    """cfg[key], which must be one of `allowed` (compared with its type: True is not 1); else a
    CheckpointError naming the quantization_config field."""
    value = cfg.get(key)
    if not any(type(value) is type(a) and value == a for a in allowed):
        field = f"quantization_config.{where + '.' if where else ''}{key}"
        wanted = " or ".join(repr(a) for a in allowed)
        raise CheckpointError(f"{field}: expected {wanted}, got {value!r}")
    return value

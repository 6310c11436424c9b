"""One-line descriptions of a loaded model as it runs: the device, the dtypes the C step and
the KV cache use, the kernel backend. What `generate`, `bench` and `serve` print and report."""

from __future__ import annotations

import torch

from quantkit.format.dtypes import name_of
from quantkit.models.kv_cache import kv_format
from quantkit.runtime.fast_path import pytorch_path_reason
from quantkit.runtime.head import head_name
from quantkit.runtime.loader import LoadedModel


def device_name(device: torch.device) -> str:
    """'cuda (NVIDIA H200)' or 'cpu (AMD EPYC ..., 2 threads)'."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    from quantkit.cpu import cpu_name

    threads = torch.get_num_threads()
    return f"cpu ({cpu_name()}, {threads} thread{'s' if threads != 1 else ''})"


def kv_dtype_name(loaded: LoadedModel) -> str:
    """The KV cache format the model's caches are built in ('float32' for an fp32 model on
    auto)."""
    return kv_format(loaded.model.kv_dtype, loaded.model.dtype).name


def act_dtype_name(loaded: LoadedModel) -> str:
    """The dtype the C step's GEMVs take their activations in ('float32' without one)."""
    path = loaded.model.decode_path
    return name_of(path.act_dtype if path is not None else torch.float32)


def backend_line(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> str:
    """The format, the activations, the kernel that ran and the head/KV dtypes where they differ
    from the model's; for a quantized model on the PyTorch path, why it is not on the C step."""
    kind = str(dtype).removeprefix("torch.")
    head = head_name(loaded.model)
    head_note = "" if head == kind else f", lm_head {head}"
    act = act_dtype_name(loaded)
    act_note = "" if act == kind else f" ({act} in the INT4 GEMVs)"
    kv = kv_dtype_name(loaded)
    head_note += "" if kv == kind else f", {kv} KV cache"
    if loaded.scheme is None:
        return f"dense {kind} (torch){head_note}"
    from quantkit.fused_kernels.kernel_registry import resolve_backend

    # resolve_backend, not choose_backend: the kernel that ran, after any fallback.
    line = (
        f"{loaded.describe()}, {kind} activations{act_note}, kernel "
        f"{resolve_backend(device, kind=loaded.scheme.kind)}{head_note}"
    )
    if (why := pytorch_path_reason(loaded.model)) is not None:
        line += f"; PyTorch decode path, not the C step: {why}"
    return line

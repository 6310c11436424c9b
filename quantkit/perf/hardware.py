"""What bounds decode and prefill on a machine: a table of GPUs, and this CPU measured.

Decode at small batch is bounded by memory bandwidth, prefill by FLOP/s; `Hardware` holds both
for one device. GPUs come from vendor datasheets (`GPUS`, looked up forgivingly by the names
`torch.cuda.get_device_name` reports); a CPU's bandwidth is measured with a copy probe and
cached under $QUANTKIT_HOME (`quantkit.perf.bandwidth`), since no datasheet knows a shared cloud
machine's share of it.

Units: bandwidth in decimal GB/s (1e9 bytes/s) as vendors publish it; memory in binary GiB;
FLOP/s are dense (no 2:4 sparsity) tensor-core peaks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

from quantkit.cpu import cpu_name
from quantkit.errors import HardwareError
from quantkit.perf.bandwidth import BandwidthRecord, cpu_bandwidth

GiB = 2**30
GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or this CPU): what bounds decode (bandwidth) and prefill (FLOP/s).

    bf16_flops: dense bf16/fp16 tensor peak; fp8_flops: dense fp8 peak, None where the chip has
    no fp8 (and for a CPU, where no FLOP/s peak is known).
    """

    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s
    bf16_flops: float | None
    fp8_flops: float | None
    source: str = "vendor datasheet"
    measurement: BandwidthRecord | None = None  # a CPU's: how and when its bandwidth was probed


def _gpu(name: str, mem_gib: int, gb_s: float, bf16_tf: float, fp8_tf: float | None) -> Hardware:
    fp8 = fp8_tf * TFLOPS if fp8_tf is not None else None
    return Hardware(name, mem_gib * GiB, gb_s * GB, bf16_tf * TFLOPS, fp8)


# Vendor datasheets, dense figures (the sparse "up to" numbers halved). GeForce cards list fp16
# tensor throughput with fp16 accumulation at twice the fp32-accumulate rate that bf16 matmuls
# in PyTorch use; the fp32-accumulate figures are given (Ampere/Ada whitepapers).
GPUS: dict[str, Hardware] = {
    g.name: g
    for g in (
        _gpu("A100 40GB SXM", 40, 1555, 312, None),
        _gpu("A100 40GB PCIe", 40, 1555, 312, None),
        _gpu("A100 80GB SXM", 80, 2039, 312, None),
        _gpu("A100 80GB PCIe", 80, 1935, 312, None),
        _gpu("H100 SXM", 80, 3350, 989.4, 1978.9),
        _gpu("H100 PCIe", 80, 2000, 756.5, 1513),
        _gpu("H100 NVL", 94, 3900, 835.5, 1670.5),
        _gpu("H200", 141, 4800, 989.4, 1978.9),
        _gpu("H200 NVL", 141, 4800, 835.5, 1670.5),
        _gpu("L4", 24, 300, 121, 242.5),
        _gpu("L40", 48, 864, 181.05, 362.05),
        _gpu("L40S", 48, 864, 362.05, 733),
        _gpu("A10", 24, 600, 125, None),
        _gpu("T4", 16, 320, 65, None),  # fp16 only: Turing has no bf16
        _gpu("RTX 3090", 24, 936, 71, None),
        _gpu("RTX 4090", 24, 1008, 165.2, 330.3),
        _gpu("MI300X", 192, 5300, 1307.4, 2614.9),
    )
}

# Extra spellings, normalized, including what torch.cuda.get_device_name reports
# ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090", ...).
_EXTRA_ALIASES: dict[str, tuple[str, ...]] = {
    "A100 40GB SXM": ("a100sxm40gb", "a100sxm440gb", "a10040gb"),
    "A100 40GB PCIe": ("a100pcie40gb",),
    "A100 80GB SXM": ("a100sxm80gb", "a100sxm480gb", "a10080gb", "a100"),
    "A100 80GB PCIe": ("a100pcie80gb",),
    "H100 SXM": ("h100sxm5", "h100sxm580gb", "h10080gbhbm3", "h100"),
    "H100 PCIe": ("h10080gbpcie", "h100pcie80gb"),
    "H200": ("h200sxm", "h200141gb", "h200sxm141gb"),
    "RTX 3090": ("3090",),
    "RTX 4090": ("4090",),
}
_NOISE = re.compile(r"nvidia|geforce|tesla|amd|instinct|[^a-z0-9]")


def _normalize(name: str) -> str:
    return _NOISE.sub("", name.lower())


_ALIASES: dict[str, str] = {_normalize(n): n for n in GPUS} | {
    alias: n for n, aliases in _EXTRA_ALIASES.items() for alias in aliases
}


def lookup_gpu(name: str) -> Hardware:
    """The table entry for `name`, ignoring case, spaces, dashes and vendor words."""
    found = _ALIASES.get(_normalize(name))
    if found is None:
        raise HardwareError(
            f"GPU: expected one of {', '.join(GPUS)} (case, spaces and dashes ignored), "
            f"got {name!r}"
        )
    return GPUS[found]


def ridge_point(hardware: Hardware, *, fp8: bool = False) -> float:
    """FLOP/byte above which a kernel is compute-bound: peak FLOP/s / peak bytes/s."""
    flops = hardware.fp8_flops if fp8 else hardware.bf16_flops
    if flops is None:
        kind = "fp8" if fp8 else "bf16"
        raise HardwareError(
            f"ridge point: expected a known {kind} peak, got none for {hardware.name}"
        )
    return flops / hardware.bandwidth


def peak_bandwidth(device: torch.device | str) -> tuple[float, str]:
    """(bytes/s, where the number came from) for `device`: GPU table or CPU measurement."""
    hardware = local_hardware(device)
    return hardware.bandwidth, hardware.source


def local_hardware(device: torch.device | str) -> Hardware:
    """The Hardware of `device`: the table entry of this CUDA GPU, or this CPU measured."""
    device = torch.device(device)
    if device.type == "cuda":
        gpu = lookup_gpu(torch.cuda.get_device_name(device))
        return replace(gpu, source=f"datasheet of {gpu.name}")
    if device.type == "cpu":
        record = cpu_bandwidth()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Hardware(
            f"CPU {cpu_name()}",
            memory,
            record.bytes_per_s,
            None,
            None,
            source=record.source(),
            measurement=record,
        )
    raise HardwareError(f"device: expected cpu or cuda, got {device.type}")

"""What bounds decode and prefill on a machine: a table of GPUs, and this CPU measured.

Decode at small batch is bounded by memory bandwidth, prefill by FLOP/s; `Hardware` holds both
for one device. GPUs come from vendor datasheets (`GPUS`, looked up forgivingly by the names
`torch.cuda.get_device_name` reports); a CPU's bandwidth is measured once with a copy benchmark
and cached under $QUANTKIT_HOME, since no datasheet knows a shared cloud machine's share of it.

Units: bandwidth in decimal GB/s (1e9 bytes/s) as vendors publish it; memory in binary GiB;
FLOP/s are dense (no 2:4 sparsity) tensor-core peaks.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from quantkit.cpu import cpu_name
from quantkit.errors import HardwareError
from quantkit.paths import quantkit_home

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


def measure_copy_bandwidth(*, seconds: float = 0.5, nbytes: int = 256 * 2**20) -> float:
    """Peak memory bandwidth of this CPU in bytes/s, from the fastest of repeated tensor copies.

    Convention (STREAM's "Copy"): a copy of S bytes reads S and writes S, and 2S / time is
    reported, the bytes the memory system moved. Decode is a read-only stream, and on the machine
    this was written on (Zen 3, 2 threads, shared) 2S/t of a copy came within 10% of a pure-read
    reduction (`x.sum()`) run beside it: 22.7 vs 22.1 GB/s under load, 45 vs 50 GB/s idle. S/t
    alone would halve the ceiling and double every MBU. Noisy neighbours only lower the result,
    so the fastest repetition is kept. `nbytes` must dwarf the last-level cache (256 MiB vs 32).
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults, not bandwidth
    best = math.inf
    deadline = time.perf_counter() + seconds
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
        reps += 1
    return 2 * src.numel() * src.element_size() / best


def cpu_peak_bandwidth(*, refresh: bool = False, seconds: float = 0.5) -> tuple[float, str]:
    """(bytes/s, source): the copy bandwidth, measured once per CPU model and thread count and
    cached in $QUANTKIT_HOME/bandwidth.json.

    `refresh` measures again and keeps the better of the two: a measurement taken while other
    processes held the cores (seen: 1.6 GB/s under a load of 10 on 2 cores, 20+ idle) can only
    be too low, and a ceiling that is too low inflates every MBU computed against it.
    """
    threads = torch.get_num_threads()
    key = f"{cpu_name()} | {threads} thread{'s' if threads != 1 else ''}"
    path = quantkit_home() / "bandwidth.json"
    cache: dict[str, Any] = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):  # a corrupt cache is re-measured, not fatal
            cache = {}
    entry = cache.get(key)
    if entry and not refresh:
        return float(entry["bytes_per_s"]), f"measured copy on {key} (cached)"
    bandwidth = measure_copy_bandwidth(seconds=seconds)
    if entry:
        bandwidth = max(bandwidth, float(entry["bytes_per_s"]))
    cache[key] = {"bytes_per_s": bandwidth, "method": "copy, (read + write) / time"}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return bandwidth, f"measured copy on {key}"


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
        bandwidth, source = cpu_peak_bandwidth()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Hardware(f"CPU {cpu_name()}", memory, bandwidth, None, None, source=source)
    raise HardwareError(f"device: expected cpu or cuda, got {device.type}")

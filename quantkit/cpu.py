"""What this CPU is and can do: the one probe of /proc/cpuinfo.

The machine changes between sessions (AVX2-only, AVX-512, AVX512-BF16 have all been seen), so
every feature is detected at run time from here: the kernel build picks its instruction-set
variant, the runtime its bf16 defaults, the reports the CPU's name.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags, the safe answer
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo does not exist)."""
    line = next((ln for ln in _cpuinfo().splitlines() if ln.startswith("flags")), "")
    return frozenset(line.split(":", 1)[-1].split())


def has_bf16_dot() -> bool:
    """True if this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _field(key: str) -> str:
    """The first /proc/cpuinfo value of `key`; "" where there is none."""
    for line in _cpuinfo().splitlines():
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return ""


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...); "" where there is none."""
    return _field("vendor_id")


def cpu_name() -> str:
    return _field("model name") or platform.processor() or platform.machine() or "unknown CPU"

"""Build the C kernels (`csrc/`) into shared libraries once per machine and load them with ctypes.

Why ctypes and plain C rather than `torch.utils.cpp_extension.load_inline`: the CPU kernels need
no torch headers, so a build is one gcc call (~1 s) instead of a C++ compile of the torch headers
(tens of seconds on 2 cores), and it needs neither ninja nor Python headers, only a C compiler
(`$CC`, default `gcc`). The library links OpenMP as `libgomp.so.1`; torch's CPU wheels already
loaded a library of that soname, so the dynamic linker reuses it and our parallel regions share
torch's thread pool instead of starting a second one that competes for the same cores.

The C lives in `csrc/` (package data): one .c file per library is its translation unit and
`#include "..."`s the rest (`common.h`, `quantkit_kernels.h`, and for the INT4 library `decode.c`
includes `w4a16.c` and `attend.c`). A build reads that file and every file it includes,
transitively, copies exactly what it read into a temporary directory and compiles it there, so
the library always matches what was hashed.

Builds are cached under `$QUANTKIT_HOME/kernels` (default `~/.cache/quantkit/kernels`), keyed by
every source file (name and content), the flags, the compiler's version and the instruction-set
variant, and written atomically (compile to a temporary name, then rename), so concurrent first
uses are safe.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from quantkit.cpu import cpu_flags
from quantkit.errors import KernelUnavailableError
from quantkit.paths import quantkit_home

# Instruction-set variants, best first, with the CPU flags each needs. AVX-512 moves 1.5x the
# bytes/s of AVX2 at 14336x4096, M=1 on one Zen 5 core (15.9 vs 10.3 GB/s): the AVX2 loop is
# bound by vector ops, not memory. -O3 lets gcc vectorise the generic fallback loops.
_VARIANTS: dict[str, tuple[frozenset[str], list[str]]] = {
    "avx512": (
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma"}),
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    ),
    "avx2": (frozenset({"avx2", "fma"}), ["-mavx2", "-mfma"]),
    "generic": (frozenset(), []),
}
_BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11"]


def supported_variants() -> list[str]:
    """The instruction-set variants this CPU can run, best first (`generic` always last)."""
    flags = cpu_flags()
    return [name for name, (needs, _) in _VARIANTS.items() if needs <= flags]


def cpu_variant() -> str:
    """The best variant for this CPU."""
    return supported_variants()[0]


def _compiler() -> str:
    cc = os.environ.get("CC", "gcc")
    path = shutil.which(cc)
    if path is None:
        raise KernelUnavailableError(
            f"cpu backend: expected a C compiler ({cc!r}, from $CC or the default gcc) on PATH "
            "to build the INT4 CPU kernel, got none; install gcc or set QUANTKIT_BACKEND=reference"
        )
    return path


# AVX-512 extensions the INT4 GEMV has a tile for, added on a CPU that has them: AVX512-BF16
# (vdpbf16ps: bf16 activations), AVX512-VNNI (vpdpbusd: int8 activations).
_AVX512_EXTRAS = {"avx512_bf16": "-mavx512bf16", "avx512_vnni": "-mavx512vnni"}


def _variant_flags(variant: str) -> list[str]:
    """The variant's compiler flags, plus the `_AVX512_EXTRAS` this AVX-512 CPU has."""
    flags = cpu_flags() if variant == "avx512" else frozenset()
    extra = [flag for name, flag in _AVX512_EXTRAS.items() if name in flags]
    return _VARIANTS[variant][1] + extra


# `#include "name"`: a file of csrc/ in the same translation unit (`<...>` ones are the
# compiler's, covered by its version).
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def kernel_sources(entry: str) -> dict[str, str]:
    """The files of the translation unit `csrc/<entry>`: {name: text}, the entry first, then each
    `#include "name"` (relative to `csrc/`, transitively, each once) in the order first met.

    Every quoted include counts, whatever `#if` it sits in, so the set covers all variants.
    """
    root = importlib.resources.files("quantkit.fused_kernels.cpu").joinpath("csrc")
    files: dict[str, str] = {}
    todo = [entry]
    while todo:
        name = todo.pop(0)
        if name in files:
            continue
        try:
            files[name] = root.joinpath(name).read_text(encoding="utf-8")
        except OSError as exc:
            raise KernelUnavailableError(
                f"cpu backend: expected the kernel source csrc/{name} in the installed package, "
                f"got {type(exc).__name__}: {exc}"
            ) from exc
        todo += _INCLUDE.findall(files[name])
    return files


def build_library(name: str, source: str, *, variant: str | None = None) -> Path:
    """Compile the C text `source` (one file, no local includes) like `build_kernels`."""
    return _build(name, {f"{name}.c": source}, variant)


def build_kernels(name: str, entry: str, *, variant: str | None = None) -> Path:
    """Compile `csrc/<entry>` (with the files it includes, see `kernel_sources`) into
    `$QUANTKIT_HOME/kernels/<name>-<variant>-<hash>.so` once.

    Returns the path of the library; a later call with the same inputs returns the cached file.
    """
    return _build(name, kernel_sources(entry), variant)


def _build(name: str, files: dict[str, str], variant: str | None) -> Path:
    """Compile the translation unit `files` (the first is the one compiled, the others are what
    it includes) for `variant`; the cache key covers every file's name and text."""
    variant = variant or cpu_variant()
    if variant not in supported_variants():
        raise KernelUnavailableError(
            f"cpu variant: expected one this CPU runs ({', '.join(supported_variants())}), "
            f"got {variant!r}"
        )
    cc = _compiler()
    flags = _BASE_FLAGS + _variant_flags(variant)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    parts = [part for item in files.items() for part in item] + [" ".join(flags), version]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    out_dir = quantkit_home() / "kernels"
    target = out_dir / f"{name}-{variant}-{key[:16]}.so"
    if _intact(target):
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{name}-") as tmp:
        for rel, text in files.items():  # exactly the hashed text, not a second read
            path = Path(tmp) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        src = Path(tmp) / next(iter(files))
        lib = Path(tmp) / f"{name}.so"
        proc = subprocess.run(
            [cc, *flags, str(src), "-o", str(lib)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise KernelUnavailableError(
                f"cpu backend: expected {Path(cc).name} to build {name} ({variant}), got exit "
                f"code {proc.returncode}: {proc.stderr.strip()[-2000:]}"
            )
        digest = Path(tmp) / "digest"
        digest.write_text(_digest(lib))
        # The digest first, then the library, each atomically: a library beside a stale digest
        # reads as damaged (rebuilt), never as sound.
        os.replace(digest, _digest_path(target))
        os.replace(lib, target)  # atomic: a reader sees no file or the whole file
    return target


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _digest(lib: Path) -> str:
    data = lib.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _intact(lib: Path) -> bool:
    """Whether the cached library is exactly the one built: size and SHA-256 against the digest
    written beside it. dlopen of a truncated library can kill the process with SIGBUS, so a
    damaged one (truncated, emptied, overwritten) is rebuilt, with one warning, before any load."""
    if not lib.exists():
        return False
    digest = _digest_path(lib)
    try:
        recorded = digest.read_text()
        if recorded == _digest(lib):
            return True
    except (OSError, UnicodeDecodeError):
        recorded = None
    if recorded is not None:  # a library from before digests were written is rebuilt quietly
        warnings.warn(
            f"kernel cache {lib}: damaged (size or SHA-256 changed); rebuilding", stacklevel=4
        )
    return False


def load_kernels(name: str, entry: str, *, variant: str | None = None) -> ctypes.CDLL:
    """Build (if needed) and dlopen the library for `csrc/<entry>`. The caller sets the
    functions' ctypes types (`abi.load` does both)."""
    return ctypes.CDLL(str(build_kernels(name, entry, variant=variant)))


# ------------------------------------------------------------------------ shared with the launchers

# dtype codes the C kernels take for activations, scales, bias and output (`csrc/common.h`).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

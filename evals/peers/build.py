"""llama.cpp for the peer benchmark: built once from source, and every process it runs stopped.

The source is the `llama-cpp-python` source distribution on the package index (it vendors
llama.cpp under `vendor/llama.cpp`), fetched with pip, so the build needs the index and cmake and
nothing else. Only the tools the benchmarks run are built (`llama-bench`, `llama-server`, and
`llama-perplexity`, `llama-quantize` for the GGUF export's comparison): Release,
`-march=native`, static llama/ggml libraries, no curl, no OpenSSL, no web UI download.

    $QUANTKIT_HOME/peers/downloads/                 the sdists pip fetched
    $QUANTKIT_HOME/peers/llama.cpp-<version>.build/ the unpacked source and cmake tree (kept
                                                    while building, so an interrupted build
                                                    resumes; removed once finished)
    $QUANTKIT_HOME/peers/llama.cpp-<version>/       the finished build: bin/llama-bench,
                                                    bin/llama-server, build.json

The finished folder appears atomically (`quantkit.paths.replace_dir`), so a folder that exists is
a complete build.

`Children` owns every subprocess the benchmark starts: each runs in its own session (a Ctrl-C at
the terminal reaches this process only), and `stop_all` ends each one's process group, on exit or
on an exception, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from quantkit.errors import QuantkitError
from quantkit.paths import file_lock, quantkit_home, replace_dir, temp_sibling

PACKAGE = "llama-cpp-python"
# llama-perplexity and llama-quantize serve the GGUF export's accuracy comparison
# (`quantkit.evals.peers.gguf_quality`).
TOOLS = ("llama-bench", "llama-server", "llama-perplexity", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",  # deprecated in newer llama.cpp (a warning), needed by older ones
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that run from any folder
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the configure step fetches the web UI
)


class PeerError(QuantkitError):
    """A peer benchmark that cannot run: no build, a failed build, a server that never came up."""

    exit_code = 4


@dataclass(frozen=True)
class LlamaBuild:
    folder: Path
    version: str  # llama-cpp-python's

    def tool(self, name: str) -> Path:
        return self.folder / "bin" / name


def peers_home() -> Path:
    return quantkit_home() / "peers"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def find_build() -> LlamaBuild:
    """The newest finished build; a PeerError saying how to make one when there is none."""
    builds = []
    for folder in peers_home().glob("llama.cpp-*"):
        version = folder.name.removeprefix("llama.cpp-")
        if folder.suffix != ".build" and all((folder / "bin" / t).is_file() for t in TOOLS):
            builds.append(LlamaBuild(folder, version))
    if not builds:
        raise PeerError(
            f"llama.cpp is not built yet (expected {' and '.join(TOOLS)} under "
            f"{peers_home()}/llama.cpp-VERSION/bin): run `python -m quantkit.evals.peers.llamacpp "
            "build` first"
        )
    return max(builds, key=lambda b: _version_key(b.version))


class Children:
    """Every subprocess the benchmark starts, stopped by `stop_all` (see the module docstring)."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def start(self, cmd: Sequence[str | Path], *, log: IO | None = None, **kw) -> subprocess.Popen:
        out = log if log is not None else kw.pop("stdout", None)
        err = subprocess.STDOUT if log is not None else kw.pop("stderr", None)
        proc = subprocess.Popen(
            [str(c) for c in cmd], stdout=out, stderr=err, start_new_session=True, **kw
        )
        self._procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str | Path], **kw) -> subprocess.CompletedProcess:
        """As subprocess.run (stdout captured as text), but stopped with the rest on exit."""
        proc = self.start(cmd, stdout=subprocess.PIPE, text=True, **kw)
        try:
            out, err = proc.communicate()
        finally:
            self.stop(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def stop(self, proc: subprocess.Popen, *, grace_s: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL after `grace_s`."""
        if proc in self._procs:
            self._procs.remove(proc)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue

    def stop_all(self) -> None:
        for proc in list(self._procs):
            self.stop(proc)

    def __enter__(self) -> Children:
        # SIGTERM raises SystemExit, so `finally` blocks and __exit__ run as for Ctrl-C.
        self._previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            signal.signal(signal.SIGTERM, self._previous)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _download(children: Children, version: str | None) -> Path:
    """The sdist (pip download, sdist only, no dependencies), into peers/downloads."""
    dest = peers_home() / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    _say(f"downloading the {spec} source distribution with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    result = children.run([*cmd, "--dest", dest, spec], stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.strip().splitlines()[-5:])
        raise PeerError(
            f"pip download {spec}: expected the sdist, got exit {result.returncode}:\n{tail}"
        )
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.tar\.gz)", result.stdout)
    if not found:
        raise PeerError(f"pip download {spec}: expected a .tar.gz, got:\n{result.stdout[-500:]}")
    return Path(found[-1])


def _cmake(children: Children, args: Sequence[str | Path], log: Path, what: str) -> None:
    with open(log, "a") as fh:
        proc = children.start(["cmake", *args], log=fh)
        try:
            rc = proc.wait()
        finally:
            children.stop(proc)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
        raise PeerError(f"{what}: expected success, got exit {rc} (log: {log}):\n{tail}")


def build(children: Children, *, version: str | None = None, force: bool = False) -> LlamaBuild:
    """Reuse a finished build (the newest, or `version`'s), else download and build one."""
    if not force:
        try:
            found = find_build()
        except PeerError:
            found = None
        if found and version in (None, found.version):
            _say(f"reusing the finished build {found.folder}")
            return found
    if shutil.which("cmake") is None:
        raise PeerError("building llama.cpp: expected cmake on PATH, got none (apt install cmake)")
    sdist = _download(children, version)
    version = sdist.name.removesuffix(".tar.gz").rsplit("-", 1)[-1]
    target = peers_home() / f"llama.cpp-{version}"
    work = peers_home() / f"llama.cpp-{version}.build"
    with file_lock(peers_home() / f"llama.cpp-{version}.lock"):
        if target.is_dir() and not force:
            return LlamaBuild(target, version)
        work.mkdir(parents=True, exist_ok=True)
        root = work / sdist.name.removesuffix(".tar.gz")
        source = root / "vendor" / "llama.cpp"
        if not (source / "CMakeLists.txt").is_file():
            _say(f"unpacking {sdist.name} ...")
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
        if not (source / "CMakeLists.txt").is_file():
            raise PeerError(f"{sdist.name}: expected vendor/llama.cpp/CMakeLists.txt, got none")
        jobs = str(os.cpu_count() or 1)
        log = work / "build.log"
        start = time.perf_counter()
        _say(f"configuring llama.cpp (log: {log}) ...")
        _cmake(children, ["-S", source, "-B", work / "build", *CMAKE_FLAGS], log, "cmake")
        _say(f"building {', '.join(TOOLS)} with {jobs} jobs (10-20 min on 2 cores) ...")
        _cmake(
            children,
            ["--build", work / "build", "--config", "Release", "-j", jobs, "--target", *TOOLS],
            log,
            "cmake --build",
        )
        seconds = time.perf_counter() - start
        staged = temp_sibling(target, "tmp")
        (staged / "bin").mkdir(parents=True)
        for tool in TOOLS:
            shutil.copy2(work / "build" / "bin" / tool, staged / "bin" / tool)
        info = {
            "package": f"{PACKAGE}=={version}",
            "cmake_flags": list(CMAKE_FLAGS),
            "build_seconds": round(seconds, 1),
            "machine": platform.machine(),
        }
        (staged / "build.json").write_text(json.dumps(info, indent=1) + "\n")
        replace_dir(staged, target)
        shutil.rmtree(work, ignore_errors=True)
    _say(f"built in {seconds / 60:.1f} min")
    return LlamaBuild(target, version)

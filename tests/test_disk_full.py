"""A real full disk: `quantize --force` over an existing checkpoint on a small tmpfs.

`test_hostile_inputs` stands a file-size limit (ulimit -f, EFBIG) in for a full disk, which
works everywhere. This test fills a real file system (ENOSPC): a tmpfs just larger than one
checkpoint, mounted in a private user + mount namespace (`unshare -rm`, no root needed where
user namespaces are allowed), holding the checkpoint that `--force` would replace. The new
checkpoint cannot fit beside it: one error line, exit 4 (environment), the old checkpoint
byte-identical, no temporary directory left but the staging directory of the finished layers
(`<output>.partial`); with room made (the tmpfs grown), the same command resumes from it and
finishes. Everything runs inside the namespace, since the mount is gone when it ends; the
script prints what the test asserts on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ENVIRONMENT = 4

# Inside the namespace: mount, copy the old checkpoint in, hash it, run the CLI, hash again,
# list what is left on the tmpfs. Arguments: mount point, old checkpoint, model dir, size.
SCRIPT = textwrap.dedent(
    """
    import hashlib, json, subprocess, sys
    from pathlib import Path
    mnt, old, model, size = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    target = mnt / "keep"
    target.mkdir()
    for p in old.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    def hashes():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in target.iterdir()}
    before = hashes()
    command = [sys.executable, "-m", "quantkit.cli.main", "quantize", model, "--method", "rtn",
               "--eval-tokens", "0", "-o", str(target), "--force"]
    ran = subprocess.run(command, capture_output=True, text=True)
    after, left = hashes(), sorted(p.name for p in mnt.iterdir())
    # Room made (the staged layers and the new checkpoint both fit): the same command resumes.
    subprocess.run(["mount", "-o", f"remount,size={3 * int(size)}", str(mnt)], check=True)
    again = subprocess.run(command, capture_output=True, text=True)
    print(json.dumps({"code": ran.returncode, "err": ran.stderr, "before": before,
                      "after": after, "left": left, "again": again.returncode,
                      "again_out": again.stdout + again.stderr,
                      "left_after": sorted(p.name for p in mnt.iterdir())}))
    """
)


def _namespace_works(folder: Path) -> str | None:
    """Why a private tmpfs cannot be mounted here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(
        ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
        capture_output=True, text=True,
    )  # fmt: skip
    return None if probe.returncode == 0 else f"no private mounts here: {probe.stderr.strip()}"


def test_a_full_tmpfs_under_force_keeps_the_old_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import json

    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    why = _namespace_works(mnt)
    if why is not None:  # the ulimit -f case in test_hostile_inputs covers the class
        pytest.skip(why)
    old = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", "auto")).save(
        tmp_path / "old", source_dir=tiny_model_dir
    )
    used = sum(p.stat().st_size for p in old.iterdir())
    # Room for the old checkpoint and a quarter of a second one: the new shard cannot fit.
    size = used + used // 4 + 64 * 1024
    env = {**os.environ, "QUANTKIT_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    proc = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", SCRIPT, mnt, old, tiny_model_dir, str(size)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = [ln for ln in result["err"].splitlines() if ln.startswith("error:")]
    assert "Traceback" not in result["err"], result["err"]
    assert result["code"] == ENVIRONMENT and len(errors) == 1, result
    assert "no space left on the device" in errors[0], errors
    assert "run the same command again to resume" in result["err"]
    assert result["after"] == result["before"]  # the old checkpoint, byte for byte
    # No temporary directory left; the finished layers wait for the next run.
    assert result["left"] == ["keep", "keep.partial"], result["left"]
    assert result["again"] == 0 and "resumed      at layer" in result["again_out"], result
    assert result["left_after"] == ["keep"], result["left_after"]

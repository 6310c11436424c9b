"""Hub ids as MODEL (`quantkit.sources.hub`), all offline.

Each test lays out a Hugging Face cache itself, in huggingface_hub's own layout
(`models--ORG--NAME/{refs, snapshots/<commit>, blobs}`), with HF_HUB_OFFLINE set, so nothing can
reach the network. The online paths (the file list read before a download, the hub's errors) run
against a stubbed `HfApi.model_info` / `snapshot_download`; offline mode stays on underneath, so
a request that slipped past a stub would fail, not go out.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from quantkit.errors import ModelSourceError
from quantkit.sources import hub
from quantkit.sources.resolve import load_state_dict, read_config, resolve_model
from tests.conftest import run_cli

REPO = "acme/tiny"
COMMIT_MAIN = hashlib.sha1(b"main").hexdigest()
COMMIT_V1 = hashlib.sha1(b"v1").hexdigest()


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, offline. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE into
    `constants` at import, so the constants are patched beside the environment."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def model_files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}


def lay_out(
    cache: Path,
    files: dict[str, bytes],
    *,
    repo: str = REPO,
    commit: str = COMMIT_MAIN,
    refs: tuple[str, ...] = ("main",),
    symlinks: bool = True,
) -> Path:
    """A cached snapshot as huggingface_hub writes it: files are symlinks into blobs/ (or plain
    files, as on a system without symlinks); refs/<name> holds the commit, no newline."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not symlinks:
            target.write_bytes(data)
            continue
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        target.symlink_to(os.path.relpath(blob, target.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def write_tree(cache: Path, names: list[str], *, commit: str = COMMIT_MAIN) -> None:
    """The tree listing a download saves (`trees/<commit>.json`, huggingface_hub's format 1)."""
    storage = cache / ("models--" + REPO.replace("/", "--"))
    files = {n: {"size": 1, "blob_id": hashlib.sha1(n.encode()).hexdigest()} for n in names}
    (storage / "trees").mkdir(parents=True, exist_ok=True)
    data = {"format_version": 1, "files": files}
    (storage / "trees" / f"{commit}.json").write_text(json.dumps(data))


def one_line_error(spec: str, *needles: str) -> str:
    with pytest.raises(ModelSourceError) as e:
        resolve_model(spec, progress=False)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("acme/tiny", ("acme/tiny", None)),
        ("acme/tiny@v1", ("acme/tiny", "v1")),
        (f"acme/tiny@{COMMIT_V1}", ("acme/tiny", COMMIT_V1)),
        ("acme/tiny@refs/pr/3", ("acme/tiny", "refs/pr/3")),
        ("acme/tiny@", None),
        ("./acme/tiny", None),
        ("/abs/acme/tiny", None),
        ("tiny", None),
        ("smollm2-135m", None),
    ],
)
def test_parse_hub_spec(spec: str, parsed: tuple[str, str | None] | None) -> None:
    assert hub.parse_hub_spec(spec) == parsed


def test_local_directory_named_like_a_hub_id_wins(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "acme" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO) == Path(REPO)


def test_a_missing_path_that_is_no_hub_id_keeps_its_error(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as e:
        resolve_model(tmp_path / "nope")
    msg = str(e.value)
    assert "does not exist" in msg and "ORG/NAME[@REVISION]" in msg and "\n" not in msg


def test_huggingface_hub_is_imported_lazily() -> None:
    # The CLI starts without huggingface_hub: no module-level import of it (or of its HTTP
    # client) in the sources package. Read from the source: a subprocess would cost torch.
    root = Path(hub.__file__).parent
    for path in root.glob("*.py"):
        top = ast.parse(path.read_text()).body
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] in ("huggingface_hub", "httpx2")], path


# --------------------------------------------------------------------------- cached, offline


@pytest.mark.parametrize("symlinks", [True, False], ids=["symlinks", "plain-files"])
def test_cached_id_resolves_offline(hf_cache: Path, tiny_model_dir: Path, symlinks: bool) -> None:
    snapshot = lay_out(hf_cache, model_files(tiny_model_dir), symlinks=symlinks)
    got = resolve_model(REPO, progress=False)
    assert got == snapshot
    assert read_config(got)["model_type"] == "llama"
    assert (got / "tokenizer.json").is_file()
    assert "model.embed_tokens.weight" in load_state_dict(got)


def test_quantize_a_hub_id_end_to_end(
    tmp_path: Path, hf_cache: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lay_out(hf_cache, model_files(tiny_model_dir))
    out = tmp_path / "ckpt"
    args = ("--bits", "4", "--method", "rtn", "--eval-tokens", "0", "-o", str(out))
    code, _, err = run_cli(capsys, "quantize", REPO, *args)
    assert code == 0, err
    assert "downloading" not in err  # cached: nothing to fetch
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (out / "tokenizer.json").is_file()


def test_revision_tag_and_commit(hf_cache: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    files = model_files(tiny_model_dir)
    main = lay_out(hf_cache, files, commit=COMMIT_MAIN, refs=("main",))
    config = json.loads(files["config.json"])
    v1_files = dict(files, **{"config.json": json.dumps({**config, "rms_norm_eps": 1e-6}).encode()})
    v1 = lay_out(hf_cache, v1_files, commit=COMMIT_V1, refs=("v1",))
    assert resolve_model(REPO, progress=False) == main
    assert resolve_model(f"{REPO}@v1", progress=False) == v1
    assert read_config(v1)["rms_norm_eps"] == 1e-6
    assert resolve_model(f"{REPO}@{COMMIT_V1}", progress=False) == v1
    assert resolve_model(f"{REPO}@{COMMIT_MAIN}", progress=False) == main
    one_line_error(f"{REPO}@v2", "acme/tiny@v2", "HF_HUB_OFFLINE", "--revision v2")


def test_offline_id_that_is_not_cached() -> None:
    one_line_error(
        "acme/absent",
        "MODEL acme/absent",
        "HF_HUB_OFFLINE is set",
        "download it first",
        "unset HF_HUB_OFFLINE",
    )


def test_pickle_only_snapshot_is_refused(hf_cache: Path, tiny_model_dir: Path) -> None:
    files = model_files(tiny_model_dir)
    files = {k: v for k, v in files.items() if not k.endswith(".safetensors")}
    lay_out(hf_cache, {**files, "pytorch_model.bin": b"pickle"})
    one_line_error(REPO, "pytorch_model.bin", "reads safetensors only", "safe_serialization=True")


@pytest.mark.parametrize("lost", ["model.safetensors", "config.json"])
def test_incomplete_cached_snapshot(hf_cache: Path, tiny_model_dir: Path, lost: str) -> None:
    # A download that stopped half-way: the saved tree listing names a file the folder lacks.
    files = model_files(tiny_model_dir)
    write_tree(hf_cache, sorted(files))
    lay_out(hf_cache, {k: v for k, v in files.items() if k != lost})
    msg = one_line_error(REPO, "unset HF_HUB_OFFLINE", "run the command again")
    assert lost in msg or "incomplete" in msg


# --------------------------------------------------------------------------- online (stubbed)


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """quantkit sees the hub as reachable; the hub's answers are set per test in the dict:
    `listing` (file names, or an exception to raise) and `download` (a callable standing in for
    snapshot_download's download). A cache look-up (local_files_only) is the real one.
    huggingface_hub stays offline underneath."""
    import huggingface_hub
    from huggingface_hub.hf_api import HfApi

    answers: dict[str, Any] = {"calls": []}
    real_snapshot_download = huggingface_hub.snapshot_download

    def model_info(self: Any, repo_id: str, *, revision: str | None = None, **kw: Any) -> Any:
        listing = answers["listing"]
        if isinstance(listing, BaseException):
            raise listing
        siblings = [SimpleNamespace(rfilename=n) for n in listing]
        return SimpleNamespace(sha=COMMIT_MAIN, siblings=siblings)

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            return real_snapshot_download(repo_id, **kwargs)
        answers["calls"].append(kwargs)
        return answers["download"](**kwargs)

    monkeypatch.setattr(hub, "_offline", lambda: False)
    monkeypatch.setattr(HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return answers


def http_error(cls: type, status: int) -> Exception:
    import httpx2

    request = httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO}")
    return cls(
        f"{status} Client Error.\nmore text", response=httpx2.Response(status, request=request)
    )


def no_download(**kwargs: Any) -> str:
    raise AssertionError("downloaded although it should have refused first")


@pytest.mark.parametrize("progress", [True, False])
def test_online_fetches_only_what_the_quantizer_reads(
    online: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    progress: bool,
) -> None:
    import huggingface_hub

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(index))
    wanted = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        *shards,
    ]
    never = [
        "README.md",
        ".gitattributes",
        "consolidated.safetensors",  # a second copy of the weights, not in the index
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "onnx/model.safetensors",
    ]
    online["listing"] = wanted + never
    folder = tmp_path / "snapshot"

    def download(**kwargs: Any) -> str:
        for pattern in kwargs["allow_patterns"]:
            (folder / pattern).parent.mkdir(parents=True, exist_ok=True)
            (folder / pattern).write_text("{}")
        return str(folder)

    online["download"] = download
    assert hub.hub_snapshot(REPO, progress=progress) == folder
    (call,) = online["calls"]
    assert sorted(call["allow_patterns"]) == sorted(wanted)
    if progress:
        assert call["tqdm_class"] is None  # huggingface_hub's own bars
    else:
        assert call["tqdm_class"](total=3).disable is True
    assert "downloading 7 files of acme/tiny" in capsys.readouterr().err


def test_pickle_only_repo_is_refused_before_download(online: dict[str, Any]) -> None:
    online["listing"] = ["config.json", "pytorch_model.bin", "README.md"]
    online["download"] = no_download
    one_line_error(REPO, "expected *.safetensors weights", "reads safetensors only")


def test_missing_id_through_the_cli(
    online: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from huggingface_hub.errors import RepositoryNotFoundError

    online["listing"] = http_error(RepositoryNotFoundError, 404)
    online["download"] = no_download
    code, _, err = run_cli(
        capsys, "quantize", "acme/nope", "--method", "rtn", "-o", str(tmp_path / "out")
    )
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 3 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: MODEL acme/nope"), err
    assert "check the spelling" in lines[0] and "HF_TOKEN" in lines[0]


def _errors() -> list[tuple[str, str, Any, tuple[str, ...]]]:
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    return [
        ("gated", REPO, (GatedRepoError, 403), ("licence", "huggingface.co/acme/tiny", "HF_TOKEN")),
        ("not-found", REPO, (RepositoryNotFoundError, 404), ("check the spelling", "HF_TOKEN")),
        ("revision", f"{REPO}@v9", (RevisionNotFoundError, 404), ("revision 'v9'", "acme/tiny")),
        ("unauthorized", REPO, (HfHubHTTPError, 401), ("HTTP 401", "HF_TOKEN")),
        ("hub-down", REPO, (HfHubHTTPError, 503), ("HTTP 503", "try again later")),
        # unreachable: the cache is the fallback, and it holds nothing
        (
            "unreachable",
            REPO,
            httpx2.ConnectError("no route"),
            ("unreachable (no route)", "found no snapshot"),
        ),
    ]


@pytest.mark.parametrize("case", _errors(), ids=lambda c: c[0])
def test_hub_errors_are_one_line(online: dict[str, Any], case: tuple) -> None:
    _, spec, error, needles = case
    online["listing"] = http_error(*error) if isinstance(error, tuple) else error
    online["download"] = no_download
    msg = one_line_error(spec, f"MODEL {spec}", *needles)
    assert "more text" not in msg


def test_unreachable_hub_falls_back_to_the_cache(
    online: dict[str, Any], hf_cache: Path, tiny_model_dir: Path
) -> None:
    import httpx2

    snapshot = lay_out(hf_cache, model_files(tiny_model_dir))
    online["listing"] = httpx2.ConnectError("no route")
    online["download"] = no_download
    assert resolve_model(REPO, progress=False) == snapshot


@pytest.mark.parametrize("failure", ["read-error", "consistency"])
def test_interrupted_download_says_run_again(online: dict[str, Any], failure: str) -> None:
    import httpx2

    def download(**kwargs: Any) -> str:
        if failure == "read-error":
            raise httpx2.ReadError("connection reset by peer")
        raise OSError("Consistency check failed: file should be of size 10 but has size 4")

    online["listing"] = ["config.json", "model.safetensors"]
    online["download"] = download
    one_line_error(REPO, "MODEL acme/tiny", "running the same command again resumes it")


def test_disk_full_during_download_stays_an_os_error(online: dict[str, Any]) -> None:
    # The machine's error, not the hub's: the CLI names it (exit 4), unchanged.
    def download(**kwargs: Any) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    online["listing"] = ["config.json", "model.safetensors"]
    online["download"] = download
    with pytest.raises(OSError) as e:
        resolve_model(REPO, progress=False)
    assert e.value.errno == errno.ENOSPC and not isinstance(e.value, ModelSourceError)

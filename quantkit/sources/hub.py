"""MODEL as a Hugging Face hub id, `ORG/NAME[@REVISION]`: a snapshot in the hub's own cache.

The snapshot lives where huggingface_hub keeps it (HF_HOME / HF_HUB_CACHE), not under
$QUANTKIT_HOME: a model that any HF tool downloaded before is found there, and HF_TOKEN,
HF_HUB_OFFLINE and the resuming of `.incomplete` files are huggingface_hub's own, not redone here.

Only what the quantizer reads comes down: config.json, generation_config.json, the tokenizer
files (`COPIED_FILES`) and the safetensors weights at the top of the repo; for a sharded model the
index and the shards it names, so a repo that also ships a consolidated copy of the weights is not
fetched twice. Pickled weights (.bin, .pth, .pt, .ckpt) never come down: a repo with nothing else
is refused from its file list, before any weight is downloaded.

huggingface_hub (and its HTTP client) is imported inside the functions: the CLI starts without it.
"""

from __future__ import annotations

import glob
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from quantkit.errors import ModelSourceError
from quantkit.format.checkpoint import COPIED_FILES, INDEX_NAME, read_weight_map

__all__ = ["HUB_SPEC", "hub_snapshot", "parse_hub_spec"]

# ORG/NAME, optionally @REVISION (a branch, a tag, a commit, or refs/pr/N).
HUB_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^\s@]+))?$")
META_FILES = frozenset({"config.json", *COPIED_FILES})
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt")


def parse_hub_spec(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` reads as a hub id, else None."""
    match = HUB_SPEC.match(spec)
    return (match["repo"], match["revision"]) if match else None


def hub_snapshot(spec: str, *, progress: bool = True) -> Path:
    """The local snapshot directory of hub id `spec`, downloaded into the HF cache if needed.

    Online, the repo's file list is read first so that a repo without safetensors is refused
    before any download; offline (HF_HUB_OFFLINE) or with the hub unreachable, the cached snapshot
    is used as it is, and refused the same way if it lacks what the quantizer needs.
    """
    parsed = parse_hub_spec(spec)
    if parsed is None:
        raise ModelSourceError(f"expected a hub id ORG/NAME[@REVISION], got {spec!r}")
    repo_id, revision = parsed
    with _hub_errors(spec, repo_id, revision):
        if _offline():
            return _cached_snapshot(spec, repo_id, revision, why=_no_hub())
        try:
            remote = _remote_listing(repo_id, revision)
        except _Unreachable as e:
            return _cached_snapshot(spec, repo_id, revision, why=_no_hub(e.__cause__))
        return _download(spec, repo_id, revision, remote, progress=progress)


# --------------------------------------------------------------------------- which files


def _wanted_files(
    spec: str, names: set[str], weight_map: Callable[[], dict[str, str]]
) -> list[str]:
    """The files of the repo the quantizer reads, from its file list `names`.

    `weight_map` reads the index when the repo is sharded; called only then, since online that
    is a request. Only top-level files count: weights in a sub-folder belong to something else.
    """
    top = {n for n in names if "/" not in n}
    if INDEX_NAME in top:
        weights = [INDEX_NAME, *sorted(set(weight_map().values()))]
    else:
        weights = sorted(n for n in top if n.endswith(".safetensors"))
    if not weights:
        raise _no_safetensors(spec, top)
    return sorted(top & META_FILES) + weights


def _no_safetensors(spec: str, top: set[str]) -> ModelSourceError:
    pickles = sorted(n for n in top if n.endswith(PICKLE_SUFFIXES))
    ggufs = sorted(n for n in top if n.endswith(".gguf"))
    if pickles:
        return ModelSourceError(
            f"MODEL {spec}: expected *.safetensors weights, got only PyTorch pickles "
            f"({', '.join(pickles[:3])}); quantkit reads safetensors only: pick a repo or "
            f"revision that has them (ORG/NAME@REVISION, e.g. a refs/pr/N conversion), or "
            f"convert it with transformers (model.save_pretrained(DIR, safe_serialization=True)) "
            f"and pass DIR"
        )
    if ggufs:
        return ModelSourceError(
            f"MODEL {spec}: expected *.safetensors weights, got only GGUF files "
            f"({', '.join(ggufs[:3])}); download one (hf download {spec.split('@')[0]} "
            f"{ggufs[0]}) and pass that .gguf file"
        )
    return ModelSourceError(
        f"MODEL {spec}: expected *.safetensors weights at the top of the repo, found none "
        f"(files: {', '.join(sorted(top)[:5]) or 'none'})"
    )


# --------------------------------------------------------------------------- online


class _Unreachable(Exception):
    """The hub could not be reached for the file list (the cause is chained): the cache may
    still hold the model, so it is looked up there, as huggingface_hub itself falls back."""


def _remote_listing(repo_id: str, revision: str | None) -> tuple[str, set[str]]:
    """(commit, the repo's file list) at `revision`."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        info = HfApi().model_info(repo_id, revision=revision)
    except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled) as e:
        raise _Unreachable from e
    return str(info.sha), {s.rfilename for s in info.siblings or ()}


def _download(
    spec: str, repo_id: str, revision: str | None, remote: tuple[str, set[str]], *, progress: bool
) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download

    commit, listing = remote

    def weight_map() -> dict[str, str]:
        index = hf_hub_download(repo_id, INDEX_NAME, revision=revision, tqdm_class=_quiet_bar())
        return read_weight_map(Path(index))

    wanted = _wanted_files(spec, listing, weight_map)
    absent = [n for n in wanted if n not in listing]
    if absent:
        raise ModelSourceError(
            f"MODEL {spec}: {INDEX_NAME} lists {absent[0]}, which the repo does not hold; "
            f"expected every shard it names (pick another revision)"
        )
    cached = _snapshot_dir(repo_id, commit)
    if todo := [n for n in wanted if not (cached / n).is_file()]:
        print(
            f"quantkit: downloading {len(todo)} files of {spec} into the Hugging Face cache "
            f"{cached.parent.parent}; if interrupted, running the command again resumes",
            file=sys.stderr,
        )
    folder = Path(
        snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=[glob.escape(n) for n in wanted],
            tqdm_class=None if progress else _quiet_bar(),
        )
    )
    if missing := [n for n in wanted if not (folder / n).is_file()]:
        raise ModelSourceError(
            f"MODEL {spec}: expected {len(wanted)} files after the download, {len(missing)} "
            f"missing ({', '.join(missing[:3])}); running the command again resumes it"
        )
    return folder


def _snapshot_dir(repo_id: str, commit: str) -> Path:
    """Where huggingface_hub keeps the snapshot of `commit` (its documented cache layout)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    return Path(constants.HF_HUB_CACHE) / folder / "snapshots" / commit


def _quiet_bar() -> type:
    """huggingface_hub's tqdm, always disabled: its own `silent_tqdm` lacks the methods that
    snapshot_download's byte bars call."""
    from huggingface_hub.utils import tqdm

    class QuietBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return QuietBar


# --------------------------------------------------------------------------- offline


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _cached_snapshot(spec: str, repo_id: str, revision: str | None, *, why: str) -> Path:
    """The cached snapshot of `repo_id` at `revision`, checked for what the quantizer needs;
    `why` says why the hub is not asked (offline, or unreachable and how)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        found = snapshot_download(
            repo_id, revision=revision, allow_patterns=["config.json"], local_files_only=True
        )
    except IncompleteSnapshotError:
        raise  # not "absent": `_hub_errors` says to resume it
    except LocalEntryNotFoundError as e:
        raise ModelSourceError(_not_cached(spec, repo_id, revision, why)) from e
    folder = Path(found)
    names = _cached_listing(repo_id, revision, folder)
    index = folder / INDEX_NAME
    # An index the tree listing names but the folder lacks: no shards to name yet; the index
    # itself is then reported missing below.
    wanted = _wanted_files(spec, names, lambda: read_weight_map(index) if index.is_file() else {})
    if missing := [n for n in wanted if not (folder / n).is_file()]:
        raise ModelSourceError(
            f"MODEL {spec}: expected {len(wanted)} files in the cached snapshot {folder}, "
            f"{len(missing)} missing ({', '.join(missing[:3])}); {why}, so "
            f"{_reach_hint()} and run the command again to finish (resume) the download"
        )
    return folder


def _cached_listing(repo_id: str, revision: str | None, folder: Path) -> set[str]:
    """The repo's files as the cache knows them: the tree listing a past download saved
    (huggingface_hub >= 1.x keeps it), plus whatever the snapshot folder holds."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir()}
    try:
        names |= {f.path for f in get_cached_repo_tree(repo_id, revision=revision)}
    except CachedRepoTreeNotFoundError:
        pass
    return names


def _no_hub(cause: BaseException | None = None) -> str:
    """Why nothing can be downloaded: offline mode, or the hub unreachable (and how)."""
    if _offline():
        return "HF_HUB_OFFLINE is set"
    return f"the hub is unreachable ({_one_line(cause)})" if cause else "the hub is unreachable"


def _reach_hint() -> str:
    return "unset HF_HUB_OFFLINE" if _offline() else "check the network (or HF_ENDPOINT, proxy)"


# --------------------------------------------------------------------------- errors


def _one_line(e: BaseException) -> str:
    """The first line of an exception's message (huggingface_hub's span several)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


@contextmanager
def _hub_errors(spec: str, repo_id: str, revision: str | None) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line ModelSourceErrors saying what to do.

    The order matters: GatedRepoError is a RepositoryNotFoundError, both and
    RevisionNotFoundError are HfHubHTTPErrors, IncompleteSnapshotError is a
    LocalEntryNotFoundError, and all of them are OSErrors. An OSError with an errno (disk full,
    permission denied) is the machine's, not the hub's: it propagates for the CLI to name.
    """
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    resume = "running the same command again resumes it (the partial files are kept)"
    try:
        yield
    except GatedRepoError as e:
        raise ModelSourceError(
            f"MODEL {spec}: expected access to gated repo {repo_id}, got refused; accept its "
            f"licence on https://huggingface.co/{repo_id}, then set HF_TOKEN or run "
            f"`hf auth login`"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelSourceError(
            f"MODEL {spec}: expected revision {revision or 'main'!r} (a branch, tag or commit) in "
            f"hub repo {repo_id}, found none by that name; check it, or drop @REVISION for the "
            f"default branch"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelSourceError(
            f"MODEL {spec}: expected a local path or a hub model repo, got neither: no such path, "
            f"and the hub has no repo {repo_id}; check the spelling (a private repo needs "
            f"HF_TOKEN or `hf auth login`)"
        ) from e
    except IncompleteSnapshotError as e:
        raise ModelSourceError(
            f"MODEL {spec}: the cached download is incomplete ({_no_hub(e.__cause__)}); "
            f"{_reach_hint()} and run the command again: it resumes the download"
        ) from e
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        why = _no_hub(e.__cause__ or e)
        raise ModelSourceError(_not_cached(spec, repo_id, revision, why)) from e
    except HfHubHTTPError as e:
        raise ModelSourceError(f"MODEL {spec}: {_http_advice(e)}") from e
    except HFValidationError as e:
        raise ModelSourceError(
            f"MODEL {spec}: expected a hub id ORG/NAME[@REVISION], got an invalid one "
            f"({_one_line(e)})"
        ) from e
    except (httpx2.TransportError, ConnectionError) as e:
        raise ModelSourceError(
            f"MODEL {spec}: the download was interrupted ({_one_line(e)}); {resume}"
        ) from e
    except OSError as e:
        if e.errno is not None:
            raise
        # errno-less: huggingface_hub's size check of a truncated file ("Consistency check").
        raise ModelSourceError(
            f"MODEL {spec}: the download is incomplete ({_one_line(e)}); {resume}"
        ) from e


def _not_cached(spec: str, repo_id: str, revision: str | None, why: str) -> str:
    """The line for a model that is not in the cache when nothing can be downloaded."""
    at = f" --revision {revision}" if revision else ""
    return (
        f"MODEL {spec}: expected it in the Hugging Face cache, found no snapshot of "
        f"{repo_id}@{revision or 'main'}, and {why}; download it first (e.g. `hf download "
        f"{repo_id}{at}` where the hub is reachable) or {_reach_hint()}"
    )


def _http_advice(e: Any) -> str:
    """What to do about an HTTP error other than not-found and gated."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status == 401:
        return (
            "the hub refused the token (HTTP 401); set a valid HF_TOKEN or run `hf auth login` "
            "(or unset HF_TOKEN for a public repo)"
        )
    if status == 429:
        return "the hub is rate-limiting requests (HTTP 429); wait a while and run it again"
    if isinstance(status, int) and status >= 500:
        return f"the hub failed (HTTP {status}); try again later: a download resumes"
    return f"expected the hub to answer, got HTTP {status}: {_one_line(e)}"

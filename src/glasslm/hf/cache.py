"""Hub names ("gpt2", "org/name") found in the local Hugging Face cache, through huggingface_hub's
own offline lookup (its layout rules, not ours); `glasslm download` (glasslm.hf.hub) fills the cache.

Example:
    >>> import tempfile
    >>> local = tempfile.mkdtemp()
    >>> resolve_model_path(local) == Path(local)   # a path that exists is taken as is
    True
    >>> is_hub_name("org/name"), is_hub_name("./runs/x"), is_hub_name("a/b/c")
    (True, False, False)
"""

from __future__ import annotations

import os
from pathlib import Path

from glasslm.locations import hf_cache_dir


def is_hub_name(spec: str) -> bool:
    """Whether `spec` is spelled as a hub repository id ("name" or "org/name"), by huggingface_hub's rule."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot directory of `repo_id` in the local HF cache, or None; nothing is downloaded.

    `revision` (a branch, tag or commit) is looked up as huggingface_hub records it (refs/NAME);
    none means main, else the newest snapshot downloaded (e.g. one fetched only with --revision).
    A snapshot holding only some of the repository's files (`glasslm download --include ...`) counts.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    # The cache is located at call time ($HF_HUB_CACHE, $HF_HOME): huggingface_hub reads them once, at import.
    cache = hf_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except IncompleteSnapshotError as partial:
        return Path(partial.snapshot_path)
    except LocalEntryNotFoundError:
        return _newest_snapshot(repo_id, cache) if revision is None else None


def _newest_snapshot(repo_id: str, cache: Path) -> Path | None:
    """The most recently written snapshot of `repo_id` in `cache` (no refs/main: fetched by another revision)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    from huggingface_hub.file_download import repo_folder_name

    if not (cache / repo_folder_name(repo_id=repo_id, repo_type="model")).is_dir():
        return None  # not there at all: no need to scan the whole cache
    try:
        repos = scan_cache_dir(cache).repos
    except CacheNotFound:
        return None
    revisions = [rev for repo in repos if repo.repo_id == repo_id and repo.repo_type == "model"
                 for rev in repo.revisions]
    return max(revisions, key=lambda rev: rev.last_modified).snapshot_path if revisions else None


def resolve_model_path(spec: str | os.PathLike, revision: str | None = None) -> Path:
    """A local path as is; a hub name ("gpt2", "org/name") as its snapshot in the local HF cache
    (`revision`: which one, see `cached_snapshot`).

    Nothing is downloaded: a name missing from the cache is an error naming where it was looked
    for and the `glasslm download` command that fetches it.
    """
    path = Path(spec)
    if path.exists() or not is_hub_name(str(spec)):
        if revision is not None:
            raise ValueError(f"--revision {revision} picks a downloaded revision of a hub model (org/name); "
                             f"{spec} is {'a local path' if path.exists() else 'not a hub name'}")
        return path
    snapshot = cached_snapshot(str(spec), revision)
    if snapshot is not None:
        return snapshot
    if path.parent != Path(".") and path.parent.is_dir():
        # "runs/nonexist" where runs/ exists: a mistyped local path, not a hub name to download.
        raise FileNotFoundError(f"{spec} does not exist (no {path.name} in {path.parent}/)")
    from huggingface_hub.file_download import repo_folder_name

    repo = hf_cache_dir() / repo_folder_name(repo_id=str(spec), repo_type="model")
    fetch = f"glasslm download {spec}" + (f" --revision {revision}" if revision else "")
    if revision is not None:
        raise FileNotFoundError(f"revision {revision} of {spec} is not in the local Hugging Face cache (looked in "
                                f"{repo}; HF_HUB_CACHE or HF_HOME choose another cache): fetch it with `{fetch}`")
    raise FileNotFoundError(
        f"{spec} is neither a local path nor a model in the local Hugging Face cache (looked in {repo}; "
        f"HF_HUB_CACHE or HF_HOME choose another cache). If it is a hub model, fetch it first with `{fetch}`; "
        "if it is a local path, check its spelling"
    )

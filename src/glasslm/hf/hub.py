"""Downloading a model from the Hugging Face Hub into the standard HF cache, through huggingface_hub
(`snapshot_download`: its progress bars, its retries and Range resumes, HF_TOKEN, HF_ENDPOINT), with
each way it can fail said in one line.

After `download_snapshot("org/name")`, every loader takes the name "org/name" (glasslm.hf.cache).

Example:
    >>> from glasslm.hf.hub import download_snapshot
    >>> download_snapshot("not a repo")
    Traceback (most recent call last):
    ...
    ValueError: 'not a repo' is not a hub repository id (org/name, e.g. HuggingFaceTB/SmolLM2-135M-Instruct)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from glasslm.hf.cache import is_hub_name
from glasslm.locations import hf_cache_dir

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError


@dataclass(frozen=True)
class HubSnapshot:
    """A downloaded revision of a hub repository: where its files are in the HF cache."""

    repo_id: str
    revision: str | None  # as asked for (none: main)
    path: Path  # the snapshot directory, named by the commit
    unchecked_because: str | None = None  # the hub could not be asked (offline): the cache answered, this is why

    @property
    def commit(self) -> str:
        return self.path.name

    def files(self) -> list[Path]:
        """The files the snapshot holds (from this download and any earlier one of the same commit)."""
        return sorted(p for p in self.path.rglob("*") if p.is_file())


def download_snapshot(repo_id: str, revision: str | None = None, include: Sequence[str] = (),
                      exclude: Sequence[str] = ()) -> HubSnapshot:
    """Fetch `repo_id` at `revision` (a branch, tag or commit; none: main) into the HF cache; only
    files matching a glob of `include` (if any) and none of `exclude`. Files already cached are not
    fetched again. Offline (HF_HUB_OFFLINE, or the hub unreachable), a snapshot already in the cache
    is returned with `unchecked_because` saying why; otherwise each failure is one line."""
    import httpx2  # what huggingface_hub speaks HTTP with: its transport errors mean "not reached"
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    if not is_hub_name(repo_id):
        raise ValueError(f"{repo_id!r} is not a hub repository id (org/name, e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    cache, patterns = hf_cache_dir(), dict(allow_patterns=list(include) or None, ignore_patterns=list(exclude) or None)
    try:
        # Asked first: whether the hub can be reached (snapshot_download falls back to the cache without
        # saying so), and whether the model exists and, if gated, the token may read it (before any progress bar).
        HfApi().auth_check(repo_id)
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, **patterns))
    except (OfflineModeIsEnabled, httpx2.TransportError) as err:
        return _from_cache(repo_id, revision, patterns, _unreachable(err))
    except LocalEntryNotFoundError as err:  # the hub went away between the two calls
        return _from_cache(repo_id, revision, patterns, _unreachable(err.__cause__ or err))
    except HfHubHTTPError as err:
        if err.response is not None and err.response.status_code >= 500:  # the hub is down: as if offline
            return _from_cache(repo_id, revision, patterns, _unreachable(err))
        raise _refusal(err, repo_id, revision) from None
    _check_something_matched(repo_id, revision, cache, patterns)
    return HubSnapshot(repo_id, revision, path)


def _check_something_matched(repo_id: str, revision: str | None, cache: Path, patterns: dict) -> None:
    """Refuse globs that matched none of the repository's files (huggingface_hub only logs a warning)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    from huggingface_hub.utils import filter_repo_objects

    try:
        names = sorted(f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache))
    except CachedRepoTreeNotFoundError:
        return  # no listing to check against
    if not list(filter_repo_objects(names, **patterns)):
        globs = [f"--include {g!r}" for g in patterns["allow_patterns"] or []] + \
                [f"--exclude {g!r}" for g in patterns["ignore_patterns"] or []]
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise FileNotFoundError(f"no file of {repo_id} matches {' '.join(globs) or 'anything'} "
                                f"(it holds {shown or 'no files'})")


def _from_cache(repo_id: str, revision: str | None, patterns: dict, reason: str) -> HubSnapshot:
    """The snapshot already in the cache when the hub cannot be asked, or one line saying what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    cache = hf_cache_dir()
    wanted = repo_id + (f" (revision {revision})" if revision else "")
    offline_advice = ("unset HF_HUB_OFFLINE to download it" if _offline_by_setting()
                      else "connect to the network (or point HF_ENDPOINT at a mirror), or set HF_HUB_OFFLINE=1 "
                           "to work only from the cache")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True, **patterns)
    except IncompleteSnapshotError as partial:
        raise ConnectionError(f"{reason}, and the cached snapshot {partial.snapshot_path} lacks files asked for; "
                              f"{offline_advice}") from None
    except LocalEntryNotFoundError:
        raise ConnectionError(f"{reason}, and {wanted} is not in the Hugging Face cache {cache}; "
                              f"{offline_advice}") from None
    return HubSnapshot(repo_id, revision, Path(path), unchecked_because=reason)


def _offline_by_setting() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _unreachable(err: BaseException) -> str:
    """Why the hub was not asked, in a few words: offline by HF_HUB_OFFLINE, or the error reaching it."""
    from huggingface_hub import constants

    if _offline_by_setting():
        return "offline (HF_HUB_OFFLINE is set)"
    detail = " ".join(str(err).split())
    return f"cannot reach {constants.ENDPOINT} ({type(err).__name__}: {detail})"


def _refusal(err: HfHubHTTPError, repo_id: str, revision: str | None) -> OSError:
    """One line for an answer of the hub that refuses the download (not found, gated, no such revision)."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    where, status = constants.ENDPOINT, err.response.status_code if err.response is not None else "no status"
    page = f"{where}/{repo_id}"
    if isinstance(err, GatedRepoError):
        if get_token() is None:
            return PermissionError(f"{repo_id} is a gated model ({where} answered {status}): accept its conditions "
                                   f"at {page}, then set HF_TOKEN to an access token of that account (or run "
                                   "`hf auth login`) and download again")
        return PermissionError(f"{repo_id} is a gated model and the token in use (HF_TOKEN or `hf auth login`) has "
                               f"no access to it ({where} answered {status}): accept its conditions at {page} with "
                               "the token's account, or use a token of an account that has")
    if isinstance(err, RepositoryNotFoundError):
        return FileNotFoundError(f"{repo_id} is not a model on {where} (it answered {status}): check the name "
                                 "(org/name); a private model also needs HF_TOKEN set to a token that can read it")
    if isinstance(err, RevisionNotFoundError):
        return FileNotFoundError(f"{repo_id} has no revision {revision!r} on {where} (it answered {status}): give a "
                                 "branch, tag or commit it has, or leave out --revision for main")
    message = " ".join(str(err).split())
    return ConnectionError(f"{where} refused {repo_id} (HTTP {status}): {message}")

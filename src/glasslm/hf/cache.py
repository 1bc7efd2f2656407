"""Hub names ("gpt2", "org/name") found in the local Hugging Face cache; glasslm never downloads.

Example:
    >>> import tempfile
    >>> local = tempfile.mkdtemp()
    >>> resolve_model_path(local) == Path(local)   # a path that exists is taken as is
    True
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from glasslm.locations import hf_cache_dir

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """A local path as is; a hub name ("gpt2", "org/name") as its snapshot in the local HF cache.

    The cache layout is models--org--name/snapshots/<revision>/, with refs/main naming the
    revision. Nothing is downloaded: a name missing from the cache is an error naming where it
    was looked for.
    """
    path = Path(spec)
    if path.exists() or not _HUB_NAME.fullmatch(str(spec)):
        return path
    repo = hf_cache_dir() / ("models--" + str(spec).replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted((repo / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime) \
        if (repo / "snapshots").is_dir() else []
    if snapshots:
        return snapshots[-1]  # no refs/main: the most recently written revision
    if path.parent != Path(".") and path.parent.is_dir():
        # "runs/nonexist" where runs/ exists: a mistyped local path, not a hub name to download.
        raise FileNotFoundError(f"{spec} does not exist (no {path.name} in {path.parent}/)")
    raise FileNotFoundError(
        f"{spec} is neither a local path nor a model in the local Hugging Face cache (looked for {repo}; "
        "HF_HUB_CACHE or HF_HOME choose another cache). If it is a hub model, glasslm never downloads: "
        f"fetch it first with `hf download {spec}`; if it is a local path, check its spelling"
    )

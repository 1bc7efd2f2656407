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
    raise FileNotFoundError(
        f"{spec} is not a local path, and the local Hugging Face cache has no {repo.name}: looked in {repo} "
        "(set HF_HUB_CACHE or HF_HOME to another cache; glasslm never downloads, so fetch it first, "
        f"e.g. `hf download {spec}`)"
    )

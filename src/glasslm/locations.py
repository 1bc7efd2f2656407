"""Where glasslm looks for files it did not make, and where it may write: the data directory
(datasets, GPT-2's tokenizer files) and the rule for output directories. One rule each, used by
every command, benchmark and script.

Example:
    >>> from glasslm.locations import data_dir
    >>> str(data_dir("/tmp/my-data"))
    '/tmp/my-data'
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

DATA_DIR_ENV = "GLASSLM_DATA_DIR"
DATA_DIR_RULE = f"--data-dir, else ${DATA_DIR_ENV}, else ~/.cache/glasslm"


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """Where datasets live: the override, else $GLASSLM_DATA_DIR, else ~/.cache/glasslm."""
    if override:
        return Path(override)
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    return Path.home() / ".cache" / "glasslm"


def hf_cache_dir() -> Path:
    """Where the Hugging Face hub keeps downloaded models: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (the huggingface_hub rules)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


INCOMPLETE_MARKER = ".prepare-incomplete"
"""The file `glasslm.data.prepare` keeps in its output directory until it has finished."""


def check_output_dir(out: str | os.PathLike, overwrite: bool = False, inputs: Sequence[str | os.PathLike] = (),
                     what: str = "output") -> None:
    """Refuse an output directory that would lose data: a file, a non-empty directory (unless
    `overwrite`), or one holding or equal to an input. Used by prepare, convert and train-tokenizer.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "x").write_text("keep me")
    >>> check_output_dir(d / "new")  # new: fine
    >>> check_output_dir(d)
    Traceback (most recent call last):
    ...
    ValueError: ... is not empty (x); choose another --out, or pass --overwrite to replace what it holds
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is an existing file, not a directory; choose another --out")
    resolved = out.resolve()
    for source in inputs:
        source = Path(source).resolve()
        if source == resolved or resolved in source.parents:
            raise ValueError(f"--out {out} would overwrite the input {source}; choose another --out")
    if not out.is_dir():
        return
    children = sorted(child.name for child in out.iterdir())
    if children and not overwrite:
        if INCOMPLETE_MARKER in children:
            raise ValueError(f"{out} holds an incomplete preparation (an interrupted prepare); "
                             "rerun prepare with --overwrite")
        shown = ", ".join(children[:4]) + (", ..." if len(children) > 4 else "")
        raise ValueError(f"{what} directory {out} is not empty ({shown}); choose another --out, "
                         "or pass --overwrite to replace what it holds")

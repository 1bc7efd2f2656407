"""Where glasslm looks for files it did not make: the data directory (datasets, GPT-2's tokenizer
files) and the Hugging Face cache. One rule each, used by every command, benchmark and script.

Example:
    >>> from glasslm.locations import data_dir
    >>> str(data_dir("/tmp/my-data"))
    '/tmp/my-data'
"""

from __future__ import annotations

import os
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

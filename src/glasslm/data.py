"""Datasets on disk and random contiguous training batches.

Known datasets are fetched from their public URL once, checked against a sha256, and kept in a
data directory: `--data-dir`, else the GLASSLM_DATA_DIR environment variable, else
~/.cache/glasslm. Offline, the error says exactly where to put the file.

Example:
    >>> import torch
    >>> tokens = torch.arange(100)
    >>> x, y = get_batch(tokens, batch_size=2, context_length=8, generator=torch.Generator().manual_seed(0))
    >>> bool((y[:, :-1] == x[:, 1:]).all())  # targets are the inputs shifted by one
    True
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from jaxtyping import Int
from torch import Tensor

DATA_DIR_ENV = "GLASSLM_DATA_DIR"


@dataclass(frozen=True)
class DatasetInfo:
    filename: str
    url: str
    sha256: str


DATASETS: dict[str, DatasetInfo] = {
    "tinyshakespeare": DatasetInfo(
        filename="tinyshakespeare.txt",
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    ),
}


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """Where datasets live: the override, else $GLASSLM_DATA_DIR, else ~/.cache/glasslm."""
    if override:
        return Path(override)
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    return Path.home() / ".cache" / "glasslm"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_dataset(name: str, directory: str | os.PathLike | None = None) -> Path:
    """Path to a known dataset's file, downloading and verifying it first if it is not there."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    info = DATASETS[name]
    target = data_dir(directory) / info.filename
    if target.is_file():
        found = sha256_of(target)
        if found != info.sha256:
            raise ValueError(f"{target} has sha256 {found}, expected {info.sha256}: delete it to re-download")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(info.url, timeout=30) as response, tempfile.NamedTemporaryFile(
            dir=target.parent, delete=False
        ) as tmp:
            shutil.copyfileobj(response, tmp)
    except (urllib.error.URLError, OSError) as err:
        raise RuntimeError(
            f"could not download dataset {name!r} from {info.url} ({err}).\n"
            f"If this machine is offline, fetch that file elsewhere and put it at {target} "
            f"(or point --data-dir / ${DATA_DIR_ENV} at a directory holding {info.filename})."
        ) from None
    found = sha256_of(Path(tmp.name))
    if found != info.sha256:
        os.unlink(tmp.name)
        raise ValueError(f"download of {info.url} has sha256 {found}, expected {info.sha256}")
    os.replace(tmp.name, target)
    return target


def resolve_text(source: str, directory: str | os.PathLike | None = None) -> Path:
    """A dataset name from DATASETS or a path to a text file."""
    if source in DATASETS:
        return fetch_dataset(source, directory)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"{source!r} is neither a known dataset ({', '.join(DATASETS)}) nor a file")
    return path


def train_val_split(tokens: Int[Tensor, "n"], val_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """First (1 - val_fraction) of the tokens for training, the rest for validation (no shuffling,
    so no validation window overlaps a training window except at the single boundary)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def get_batch(
    tokens: Int[Tensor, "n"],
    batch_size: int,
    context_length: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """Random contiguous windows: inputs tokens[i : i+T] and next-token targets tokens[i+1 : i+T+1]."""
    n_starts = len(tokens) - context_length
    if n_starts < 1:
        raise ValueError(
            f"dataset of {len(tokens)} tokens is too small for one window of context_length "
            f"{context_length} + 1 target; use more text or a shorter context"
        )
    starts = torch.randint(n_starts, (batch_size,), generator=generator)
    offsets = starts[:, None] + torch.arange(context_length + 1)  # (batch, seq + 1)
    windows = tokens[offsets].long()
    x, y = windows[:, :-1], windows[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)

"""The one train/validation split rule: in each text file, text from the first line start at or
after (1 - val_fraction) of its bytes is validation text (`split_offset`). It serves `prepare`,
`train --data file.txt` and `eval --split` alike; tokens that come from no file are split by count
(`train_val_split`).

Example:
    >>> import torch
    >>> train, val = train_val_split(torch.arange(10))
    >>> len(train), len(val), VAL_FRACTION
    (9, 1, 0.1)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

from jaxtyping import Int
from torch import Tensor

VAL_FRACTION = 0.1
"""The default share of the data held out for validation (the end of each text file)."""

Split = Literal["train", "val", "all"]
SPLITS: tuple[Split, ...] = get_args(Split)


def check_val_fraction(val_fraction: float) -> None:
    """Refuse a validation fraction outside (0, 1).

    >>> check_val_fraction(1.0)
    Traceback (most recent call last):
    ...
    ValueError: val_fraction must be in (0, 1), got 1.0
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")


def train_val_split(tokens: Int[Tensor, "n"], val_fraction: float = VAL_FRACTION) -> tuple[Tensor, Tensor]:
    """First (1 - val_fraction) of the tokens for training, the rest for validation (no shuffling,
    so no validation window overlaps a training window except at the single boundary).

    For tokens that do not come from a text file; text is split by `split_offset`, on a line start."""
    check_val_fraction(val_fraction)
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def split_offset(path: str | os.PathLike, val_fraction: float = VAL_FRACTION) -> int:
    """Byte offset where a file's validation text starts: the first line start at or after
    (1 - val_fraction) of its bytes, or the next UTF-8 character boundary if no newline follows
    within 1 MiB. The one split rule of `prepare`, `train --data file.txt` and `eval --split`.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "t.txt"; _ = f.write_text("aaaa\\nbbbb\\ncccc\\n")
    >>> split_offset(f, 0.3)  # 70% of 15 bytes is byte 10, which starts the line "cccc"
    10
    >>> split_offset(f, 0.4)  # 60% is byte 9, the newline ending "bbbb": the next line starts at 10
    10
    """
    check_val_fraction(val_fraction)
    path = Path(path)
    size = path.stat().st_size
    cut = int(size * (1.0 - val_fraction))
    if cut == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(cut - 1)
        ahead = f.read(1 << 20)  # ahead[0] is the byte before the cut
    newline = ahead.find(b"\n")
    if newline >= 0:
        return cut + newline
    ahead = ahead[1:]
    step = 0
    while step < len(ahead) and ahead[step] & 0xC0 == 0x80:  # skip UTF-8 continuation bytes
        step += 1
    return cut + step


def split_texts(path: str | os.PathLike, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """(train text, validation text) of a UTF-8 file, cut at `split_offset`.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "t.txt"; _ = f.write_text("aaaa\\nbbbb\\ncccc\\n")
    >>> split_texts(f, 0.3)
    ('aaaa\\nbbbb\\n', 'cccc\\n')
    """
    data = Path(path).read_bytes()
    cut = split_offset(path, val_fraction)
    try:
        return data[:cut].decode("utf-8"), data[cut:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err})") from None


def read_split(path: str | os.PathLike, split: Split, val_fraction: float = VAL_FRACTION) -> str:
    """The text of one split of a file ("train", "val" or "all"), by `split_offset`'s rule."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    train, val = split_texts(path, val_fraction)
    return {"train": train, "val": val, "all": train + val}[split]

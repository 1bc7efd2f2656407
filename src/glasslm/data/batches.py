"""Random contiguous training batches, and the training data a run reads (`load_training_data`).

Example:
    >>> import torch
    >>> tokens = torch.arange(100)
    >>> x, y = get_batch(tokens, batch_size=2, context_length=8, generator=torch.Generator().manual_seed(0))
    >>> bool((y[:, :-1] == x[:, 1:]).all())  # targets are the inputs shifted by one
    True
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from glasslm.data.datasets import resolve_text
from glasslm.data.prepared import TokenData, is_prepared, load_prepared
from glasslm.data.sharded import ShardedTokens
from glasslm.data.splits import VAL_FRACTION, split_texts
from glasslm.tokenizers import ENDOFTEXT, CharTokenizer


def get_batch(
    tokens: Int[Tensor, "n"] | np.ndarray | ShardedTokens,
    batch_size: int,
    context_length: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """Random contiguous windows: inputs tokens[i : i+T] and next-token targets tokens[i+1 : i+T+1].

    `tokens` may be a 1-D tensor or numpy array, including a memory-mapped token file, or a sharded
    dataset's `ShardedTokens` (windows may span two shards: the stream is one): only the sampled
    windows are read from disk. Starts are uniform over every full window, drawn from
    `generator` (torch's global generator if None). Both outputs are int64 on `device`.
    (`window_starts` then `read_windows`: a process that trains on some of the rows draws every
    start, so its generator moves as everyone's, and reads only its own windows.)

    >>> x, y = get_batch(np.arange(100), batch_size=2, context_length=4, device="cpu")
    >>> x.shape, bool((y == x + 1).all())
    (torch.Size([2, 4]), True)
    """
    if isinstance(device, torch.Generator):
        raise TypeError("get_batch's 4th argument is the device; pass the generator as generator=...")
    starts = window_starts(len(tokens), batch_size, context_length, generator)
    return read_windows(tokens, starts, context_length, device)


def window_starts(n_tokens: int, batch_size: int, context_length: int,
                  generator: torch.Generator | None = None) -> Int[Tensor, "batch"]:
    """`batch_size` window starts, uniform over every full window of a stream of `n_tokens` tokens.

    >>> window_starts(10, 3, 4, torch.Generator().manual_seed(0)).tolist()
    [2, 3, 5]
    """
    n_starts = n_tokens - context_length
    if n_starts < 1:
        raise ValueError(
            f"dataset of {n_tokens} tokens is too small for one window of context_length "
            f"{context_length} + 1 target; use more text or a shorter context"
        )
    return torch.randint(n_starts, (batch_size,), generator=generator)


def read_windows(tokens: Int[Tensor, "n"] | np.ndarray | ShardedTokens, starts: Int[Tensor, "batch"],
                 context_length: int, device: torch.device | str = "cpu",
                 ) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """(inputs, targets) of the windows at `starts`; from a memory map or shards only these are read.

    >>> x, y = read_windows(np.arange(100), torch.tensor([5, 50]), 3)
    >>> x.tolist(), y[:, -1].tolist()
    ([[5, 6, 7], [50, 51, 52]], [8, 53])
    """
    offsets = starts[:, None] + torch.arange(context_length + 1)  # (batch, seq + 1)
    if not isinstance(tokens, Tensor):  # a numpy array, a memory map, or ShardedTokens
        windows = torch.from_numpy(tokens[offsets.numpy()].astype(np.int64))
    else:
        windows = tokens[offsets].long()
    x, y = windows[:, :-1], windows[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def load_training_data(source: str, directory: str | os.PathLike | None = None, val_fraction: float = VAL_FRACTION,
                       tokenizer: Any | None = None, char_end_of_text: bool = True) -> TokenData:
    """A prepared dataset directory, or a text file / dataset name tokenized in memory
    (character-level unless a tokenizer is given: the text's characters, then `<|endoftext|>`
    unless `char_end_of_text` is False, as for presets reproducing a vocabulary without one)."""
    if is_prepared(source):
        return load_prepared(source)
    path = resolve_text(source, directory)
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty")
    train_text, val_text = split_texts(path, val_fraction)  # the same split as `prepare`
    tokenizer = tokenizer or CharTokenizer.from_text(train_text + val_text, (ENDOFTEXT,) if char_end_of_text else ())
    train = torch.tensor(tokenizer.encode(train_text), dtype=torch.long)
    val = torch.tensor(tokenizer.encode(val_text), dtype=torch.long)
    return TokenData(train, val, tokenizer, f"{path} ({len(train_text) + len(val_text):,} characters, "
                                            f"vocab {tokenizer.vocab_size}, {len(train):,} train / "
                                            f"{len(val):,} val tokens)", str(path))

"""What every tokenizer shares: the `Tokenizer` interface, the end-of-text token, the names of the
files tokenizers are saved in, and the special-token roles (bos / eos / pad / unk).

Example:
    >>> from glasslm.tokenizers.char import CharTokenizer
    >>> isinstance(CharTokenizer.from_text("ab"), Tokenizer), ENDOFTEXT
    (True, '<|endoftext|>')
    >>> checked_ids([1, 0], vocab_size=2)
    [1, 0]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Literal, Protocol, get_args, runtime_checkable

ENDOFTEXT = "<|endoftext|>"
"""GPT-2's end-of-text token: the default special token of a trained BPE, and its bos and eos."""

# File names. glasslm's own formats get names of their own: HF loaders take tokenizer.json as theirs.
HF_TOKENIZER_FILE = "tokenizer.json"  # a Hugging Face tokenizer.json
# A tokenizer.json: HF's, or a char descriptor written before that had a name of its own.
TOKENIZER_FILE = HF_TOKENIZER_FILE
CHAR_DESCRIPTOR_FILE = "glasslm_char_tokenizer.json"  # CharTokenizer's descriptor
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
BPE_DESCRIPTOR_FILE = "glasslm_tokenizer.json"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
MERGES_HEADER = "#version: 0.2"
SPM_FILE = "tokenizer.model"
# Any one of these in a directory means it holds a saved tokenizer (`load_tokenizer` tells which kind).
TOKENIZER_FILES = (BPE_DESCRIPTOR_FILE, CHAR_DESCRIPTOR_FILE, TOKENIZER_FILE, SPM_FILE)

Role = Literal["bos", "eos", "pad", "unk"]
SPECIAL_ROLES: tuple[Role, ...] = get_args(Role)


@runtime_checkable
class Tokenizer(Protocol):
    """What the model, data and training code may rely on."""

    kind: str
    special_tokens: dict[str, int]

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_iterable(self, chunks: Iterable[str]) -> Iterator[int]: ...

    def save(self, directory: str | os.PathLike) -> None: ...


def checked_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    """`ids` as a list of ints (a tensor or array too), refusing any outside [0, vocab_size).

    Example:
        >>> checked_ids([0, 5], vocab_size=3)
        Traceback (most recent call last):
        ...
        ValueError: token id 5 is outside the vocabulary (size 3)
    """
    ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    return ids


def read_tokenizer_config(directory: str | os.PathLike) -> dict:
    """A directory's `tokenizer_config.json` as a dict ({} when it has none)."""
    path = Path(directory) / HF_TOKENIZER_CONFIG
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def write_tokenizer_config(directory: str | os.PathLike, config: Mapping) -> None:
    """Write `config` as the directory's `tokenizer_config.json`."""
    text = json.dumps(dict(config), indent=2, ensure_ascii=False)
    (Path(directory) / HF_TOKENIZER_CONFIG).write_text(text, encoding="utf-8")

"""Tokenizers: text <-> token ids, all behind one small interface.

Every tokenizer has `vocab_size`, `encode(text) -> list[int]`, `decode(ids) -> str`,
`encode_iterable(chunks) -> Iterator[int]`, and `save(directory)`; `load_tokenizer(directory)`
reads back whatever `save` wrote (a `tokenizer.json` naming the kind, plus the kind's own files).

Example:
    >>> tok = CharTokenizer.from_text("hello world")
    >>> tok.decode(tok.encode("hello"))
    'hello'
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


class CharTokenizer:
    """One token per Unicode character seen in the training text, ids in sorted character order."""

    kind = "char"

    def __init__(self, chars: Sequence[str]):
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError("a character vocabulary must be distinct single characters")
        self.chars = list(chars)
        self._to_id = {c: i for i, c in enumerate(self.chars)}
        self.special_tokens: dict[str, int] = {}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        if not text:
            raise ValueError("cannot build a character vocabulary from empty text")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in this tokenizer's vocabulary") from None

    def encode_iterable(self, chunks: Iterable[str]) -> Iterator[int]:
        for chunk in chunks:
            yield from self.encode(chunk)

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.chars):
                raise ValueError(f"token id {i} is outside the vocabulary (size {len(self.chars)})")
            out.append(self.chars[i])
        return "".join(out)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / TOKENIZER_FILE).write_text(json.dumps(self.to_dict(), ensure_ascii=False))


def load_tokenizer(directory: str | os.PathLike) -> CharTokenizer:
    """Read the tokenizer that `save(directory)` wrote."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer found: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "char":
        return CharTokenizer(data["chars"])
    raise ValueError(f"{path}: unknown tokenizer kind {kind!r}")

"""The character tokenizer: one id per Unicode character seen in the training text.

Saved as `tokenizer.json` = {"kind": "char", "chars": [...]} (told apart from a Hugging Face
`tokenizer.json` by its "kind" key).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from glasslm.tokenizers.base import TOKENIZER_FILE, checked_ids


class CharTokenizer:
    """One token per Unicode character seen in the training text, ids in sorted character order.

    Example:
        >>> tok = CharTokenizer.from_text("abca")
        >>> tok.vocab_size, tok.encode("cab")
        (3, [2, 0, 1])
    """

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
        return "".join(self.chars[i] for i in checked_ids(ids, len(self.chars)))

    def to_dict(self) -> dict:
        """The descriptor saved as `tokenizer.json`."""
        return {"kind": self.kind, "chars": self.chars}

    @classmethod
    def from_dict(cls, data: dict, where: str | os.PathLike = TOKENIZER_FILE) -> "CharTokenizer":
        """The tokenizer a `to_dict` descriptor describes (`where` names it in errors).

        Example:
            >>> CharTokenizer.from_dict({"kind": "char", "chars": ["a", "b"]}).encode("ba")
            [1, 0]
        """
        chars = data.get("chars")
        if not isinstance(chars, list) or not chars or not all(isinstance(c, str) for c in chars):
            raise ValueError(f"{where}: a character tokenizer needs \"chars\", a list of its characters; "
                             f"got {type(chars).__name__ if chars is not None else 'none'}")
        return cls(chars)

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / TOKENIZER_FILE).write_text(json.dumps(self.to_dict(), ensure_ascii=False))

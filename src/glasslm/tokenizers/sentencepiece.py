"""SentencePiece `tokenizer.model` files (Llama 1/2 style), run by the sentencepiece package (an
optional dependency: the import happens when such a file is read).

Saved as `tokenizer.model` + `tokenizer_config.json`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from glasslm.tokenizers.base import SPECIAL_ROLES, SPM_FILE, Role, checked_ids, read_tokenizer_config, write_tokenizer_config


class SentencePieceTokenizer:
    """A SentencePiece `tokenizer.model` (Llama 1/2 style), run by the sentencepiece package.

    Only used where a directory has no `tokenizer.json`; like `HFTokenizer.encode`, `encode`
    adds no bos/eos.
    """

    kind = "sentencepiece"

    def __init__(self, model_bytes: bytes, config: Mapping | None = None):
        try:
            import sentencepiece
        except ImportError:
            raise ImportError("this tokenizer is a SentencePiece tokenizer.model, which needs the sentencepiece "
                              "package: pip install sentencepiece (or save it with transformers as tokenizer.json)") from None
        self.model_bytes = model_bytes
        self.sp = sentencepiece.SentencePieceProcessor(model_proto=model_bytes)
        self.config = dict(config or {})
        n = self.sp.get_piece_size()
        self.special_tokens = {self.sp.id_to_piece(i): i for i in range(n)
                               if self.sp.is_control(i) or self.sp.is_unknown(i)}

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> "SentencePieceTokenizer":
        return cls((Path(directory) / SPM_FILE).read_bytes(), read_tokenizer_config(directory))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_iterable(self, chunks: Iterable[str]) -> Iterator[int]:
        yield from self.encode("".join(chunks))

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode(checked_ids(ids, self.vocab_size))

    def role_ids(self) -> dict[Role, int | None]:
        ids = {role: getattr(self.sp, f"{role}_id")() for role in SPECIAL_ROLES}  # -1: the model has none
        return {role: (i if i >= 0 else None) for role, i in ids.items()}

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / SPM_FILE).write_bytes(self.model_bytes)
        write_tokenizer_config(path, self.config)

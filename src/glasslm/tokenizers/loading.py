"""Reading a saved tokenizer of any kind (`load_tokenizer`), and making one from a short spec
(`get_tokenizer`: "char", "gpt2" or a directory).

Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> get_tokenizer("char", text="hello").save(d)
    >>> load_tokenizer(d).encode("hole")
    [1, 3, 2, 0]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from glasslm.tokenizers.base import SPM_FILE, TOKENIZER_FILE, TOKENIZER_FILES, Tokenizer
from glasslm.tokenizers.bpe import GPT2_NAME, Backend, BPETokenizer
from glasslm.tokenizers.char import CharTokenizer
from glasslm.tokenizers.gpt2 import gpt2_tokenizer
from glasslm.tokenizers.hf import HFTokenizer
from glasslm.tokenizers.sentencepiece import SentencePieceTokenizer


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Read the tokenizer that `save(directory)` wrote (any kind).

    Looks for glasslm's own descriptors first, `glasslm_tokenizer.json` (BPE) and
    `glasslm_char_tokenizer.json` (char), then `tokenizer.json` (a Hugging Face one, or a char
    descriptor older glasslm wrote under that name), then SentencePiece's `tokenizer.model`. A
    checkpoint holding a descriptor and HF's files of the same tokenizer loads from the descriptor.
    """
    root = Path(directory)
    path = next((root / name for name in TOKENIZER_FILES if (root / name).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no tokenizer found in {root}: none of {', '.join(TOKENIZER_FILES)} exists")
    if path.name == SPM_FILE:
        return SentencePieceTokenizer.from_directory(root)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == CharTokenizer.kind:
        return CharTokenizer.from_dict(data, path)
    if kind == BPETokenizer.kind:
        return BPETokenizer.load(root)
    if kind is None and isinstance(data, dict) and "model" in data and path.name == TOKENIZER_FILE:
        return HFTokenizer.from_directory(root)  # a Hugging Face tokenizer.json
    raise ValueError(f"{path}: unknown tokenizer kind {kind!r}")


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """True if `directory` holds a saved tokenizer of any kind (`load_tokenizer` reads it)."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def get_tokenizer(
    spec: str | os.PathLike,
    *,
    text: str | None = None,
    data_dir: str | os.PathLike | None = None,
    backend: Backend = "auto",
) -> Tokenizer:
    """Make a tokenizer from a short spec.

    * "char": a `CharTokenizer` over the characters of `text` (required), then `<|endoftext|>`.
    * "gpt2": GPT-2's tokenizer from local files (see `gpt2_tokenizer`; `data_dir`, `backend`).
    * a directory written by a tokenizer's `save`.

    Example:
        >>> get_tokenizer("char", text="abc").vocab_size  # a, b, c and <|endoftext|>
        4
    """
    if spec == CharTokenizer.kind:
        if text is None:
            raise ValueError("get_tokenizer('char') needs the text to take characters from: text=...")
        return CharTokenizer.from_text(text)
    if spec == GPT2_NAME:
        return gpt2_tokenizer(data_dir, backend=backend)
    if Path(spec).is_dir():
        return load_tokenizer(spec)
    raise ValueError(f"unknown tokenizer {str(spec)!r}: use 'char', 'gpt2' or a saved tokenizer directory")

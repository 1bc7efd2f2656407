"""The character tokenizer: one id per Unicode character seen in the training text, then its
special tokens (`<|endoftext|>` for the tokenizers glasslm builds from text).

Saved as `glasslm_char_tokenizer.json` = {"kind": "char", "chars": [...], "special_tokens":
{"<|endoftext|>": 65}}. Older glasslm wrote it as `tokenizer.json` (Hugging Face's name; told apart
from HF's format by its "kind" key), and those files still load. Files written before char
tokenizers had special tokens have no "special_tokens" and load as they always did: the same ids,
no end-of-text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from glasslm.tokenizers.base import CHAR_DESCRIPTOR_FILE, ENDOFTEXT, checked_ids
from glasslm.tokenizers.pretokens import encode_with_specials, special_split_pattern


class CharTokenizer:
    """One token per Unicode character, ids in sorted character order, then the special tokens.

    `from_text` (what training builds) adds `<|endoftext|>` after the characters, as a trained BPE
    has it: export writes it as bos and eos, so transformers' `generate` can stop at it. As in the
    BPE tokenizer, the special token written in text encodes as its single id and decodes back to
    its text. `CharTokenizer(chars)` alone has no special tokens (how older files load).

    Example:
        >>> tok = CharTokenizer.from_text("abca")
        >>> tok.vocab_size, tok.encode("cab"), tok.special_tokens
        (4, [2, 0, 1], {'<|endoftext|>': 3})
        >>> tok.encode("ab<|endoftext|>c"), tok.decode([0, 3, 2])
        ([0, 1, 3, 2], 'a<|endoftext|>c')
        >>> CharTokenizer(["a", "b"]).vocab_size
        2
    """

    kind = "char"

    def __init__(self, chars: Sequence[str], special_tokens: Iterable[str] | Mapping[str, int] | None = None):
        if len(set(chars)) != len(chars) or any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise ValueError("a character vocabulary must be distinct single characters")
        self.chars = list(chars)
        self._to_id = {c: i for i, c in enumerate(self.chars)}
        self.special_tokens: dict[str, int] = self._register_specials(special_tokens or {})
        self._tokens = self.chars + sorted(self.special_tokens, key=self.special_tokens.__getitem__)  # id -> text
        self._special_re = special_split_pattern(self.special_tokens)
        self._longest_special = max(map(len, self.special_tokens), default=0)

    def _register_specials(self, specials: Iterable[str] | Mapping[str, int]) -> dict[str, int]:
        """Special token -> id, the ids following the characters in order (a mapping must say so)."""
        names = list(specials)
        if any(not isinstance(s, str) or len(s) < 2 for s in names) or len(set(names)) != len(names):
            raise ValueError(f"special tokens must be distinct strings of two or more characters, got {names!r} "
                             "(a single character is an ordinary token)")
        expected = {s: len(self.chars) + k for k, s in enumerate(names)}
        if isinstance(specials, Mapping):
            given = {s: specials[s] for s in names}
            ints = all(isinstance(i, int) and not isinstance(i, bool) for i in given.values())
            if not ints or sorted(given.values()) != sorted(expected.values()):
                raise ValueError(f"special token ids must follow the {len(self.chars)} characters "
                                 f"({len(self.chars)}..{len(self.chars) + len(names) - 1}), got {given}")
            return dict(sorted(given.items(), key=lambda item: item[1]))
        return expected

    @classmethod
    def from_text(cls, text: str, special_tokens: Iterable[str] = (ENDOFTEXT,)) -> "CharTokenizer":
        """The characters of `text`, sorted, then `special_tokens` (by default `<|endoftext|>`)."""
        if not text:
            raise ValueError("cannot build a character vocabulary from empty text")
        return cls(sorted(set(text)), special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids for `text`, taking special-token strings as ordinary characters."""
        try:
            return [self._to_id[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in this tokenizer's vocabulary") from None

    def encode(self, text: str) -> list[int]:
        """Ids for `text`; a special token written in it becomes its single id (longest match wins)."""
        return encode_with_specials(text, self._special_re, self.special_tokens, self.encode_ordinary)

    def encode_iterable(self, chunks: Iterable[str]) -> Iterator[int]:
        """`encode("".join(chunks))`, lazily: a special token cut across chunks is still found."""
        if self._special_re is None:
            for chunk in chunks:
                yield from self.encode(chunk)
            return
        held = ""  # the tail that could still be the start of a special token
        for chunk in chunks:
            text = held + chunk
            # A special token starting before `cut` lies wholly in `text`; one crossing it is kept whole.
            cut = max(len(text) - self._longest_special + 1, 0)
            for match in self._special_re.finditer(text, 0, len(text)):
                if match.start() >= cut:
                    break
                cut = max(cut, match.end())
            yield from self.encode(text[:cut])
            held = text[cut:]
        yield from self.encode(held)

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self._tokens[i] for i in checked_ids(ids, len(self._tokens)))

    def to_dict(self) -> dict:
        """The descriptor saved as `glasslm_char_tokenizer.json` (no "special_tokens" key when it has none)."""
        data: dict = {"kind": self.kind, "chars": self.chars}
        if self.special_tokens:
            data["special_tokens"] = dict(self.special_tokens)
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str | os.PathLike = CHAR_DESCRIPTOR_FILE) -> "CharTokenizer":
        """The tokenizer a `to_dict` descriptor describes (`where` names it in errors).

        Example:
            >>> CharTokenizer.from_dict({"kind": "char", "chars": ["a", "b"]}).encode("ba")
            [1, 0]
            >>> CharTokenizer.from_dict({"kind": "char", "chars": ["a"], "special_tokens": {"<|endoftext|>": 1}}).vocab_size
            2
        """
        chars = data.get("chars")
        if not isinstance(chars, list) or not chars or not all(isinstance(c, str) for c in chars):
            raise ValueError(f"{where}: a character tokenizer needs \"chars\", a list of its characters; "
                             f"got {type(chars).__name__ if chars is not None else 'none'}")
        specials = data.get("special_tokens", {})
        if not isinstance(specials, dict):
            raise ValueError(f"{where}: \"special_tokens\" must map each special token to its id; "
                             f"got {type(specials).__name__}")
        try:
            return cls(chars, specials)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / CHAR_DESCRIPTOR_FILE).write_text(json.dumps(self.to_dict(), ensure_ascii=False))

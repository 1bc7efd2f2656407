"""Pre-tokenization, shared by the BPE encoder and the BPE trainer: GPT-2's regex that cuts text
into pre-tokens (merges never cross one), splitting at special tokens (and encoding around them), and where text can be cut
without changing how it pre-tokenizes.

Example:
    >>> from glasslm.tokenizers.pretokens import PRETOKEN_RE
    >>> PRETOKEN_RE.findall("it's  2024!")
    ['it', "'s", ' ', ' 2024', '!']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import regex

PRETOKEN_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""GPT-2's pre-tokenizer: contractions, letter runs, number runs, other-symbol runs (each may take
one leading space), then whitespace (a run followed by text leaves its last space to that text)."""



def __getattr__(name: str) -> Any:
    """`PRETOKEN_RE` (`PRETOKEN_PATTERN` compiled), made on first use: the `regex` package takes ~20-30 ms
    to import, which loading a GGUF or Hugging Face model (the tokenizers library's tokenizers) never needs."""
    if name != "PRETOKEN_RE":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import regex

    globals()["PRETOKEN_RE"] = compiled = regex.compile(PRETOKEN_PATTERN)
    return compiled


def special_split_pattern(special_tokens: Iterable[str]) -> regex.Pattern | None:
    """A regex matching any special token, the longest first where several match at one place.

    Regex alternation takes the first alternative that matches, so sorting by length (descending)
    makes `<|a|><|a|>` win over `<|a|>`. Returns None for no special tokens.

    Example:
        >>> special_split_pattern(["<|a|>", "<|a|><|a|>"]).findall("x<|a|><|a|><|a|>")
        ['<|a|><|a|>', '<|a|>']
    """
    tokens = sorted(set(special_tokens), key=lambda s: (-len(s), s))
    if not tokens:
        return None
    if any(not t for t in tokens):
        raise ValueError("special tokens must be non-empty strings")
    import regex

    return regex.compile("|".join(regex.escape(t) for t in tokens))


def safe_cut_pattern(special_tokens: Sequence[str], as_bytes: bool = False) -> regex.Pattern | None:
    """A regex whose matches *start* at positions where text can be cut without changing
    pre-tokenization: the start of a special token, or just after a newline between two printable
    ASCII characters.

    Why the newline rule is safe for `PRETOKEN_PATTERN`: no pre-token spans a newline and a
    non-space character, so the pre-token ending in `x` stops at the newline either way; the lone
    newline is its own pre-token whether `y` or the end of the text follows it; and the pattern has
    no look-behind, so whatever starts at `y` does not depend on what came before. The newline rule
    is left out if some special token itself contains a newline (a cut could land inside it).
    """
    import regex

    alternatives = []
    specials = sorted(set(special_tokens), key=lambda s: (-len(s), s))
    if specials:
        alternatives += [regex.escape(s) for s in specials]
    if not any("\n" in s for s in specials):
        alternatives.append(r"(?<=[\x21-\x7e]\n)(?=[\x21-\x7e])")
    pattern = "|".join(alternatives)
    return regex.compile(pattern.encode() if as_bytes else pattern)


def encode_with_specials(text: str, pattern: regex.Pattern | None, special_ids: Mapping[str, int],
                         encode_ordinary: Callable[[str], list[int]]) -> list[int]:
    """`text`'s ids: each special token `pattern` finds becomes its single id, the text between
    them goes through `encode_ordinary` (shared by the BPE and character tokenizers).

    Example:
        >>> encode_with_specials("ab<|x|>c", special_split_pattern(["<|x|>"]), {"<|x|>": 9}, lambda t: [ord(c) for c in t])
        [97, 98, 9, 99]
    """
    if pattern is None:
        return encode_ordinary(text)
    ids: list[int] = []
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            ids += encode_ordinary(text[pos : match.start()])
        ids.append(special_ids[match.group()])
        pos = match.end()
    return ids + encode_ordinary(text[pos:]) if pos < len(text) else ids

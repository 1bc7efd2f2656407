"""Text to token tensors and back, as TransformerLens's `to_tokens`, `to_str_tokens` and `to_string` do it.

TransformerLens puts the tokenizer's beginning-of-text token first by default (`prepend_bos=True`), so
a text's first real token has something to attend to; so does `to_tokens` here, where the tokenizer
has a bos (GPT-2's and glasslm's char and BPE tokenizers: `<|endoftext|>`; Llama's `<s>`, Gemma's
`<bos>`). A tokenizer without one gets nothing prepended. Several texts are padded on the right (with
the tokenizer's pad, else its eos, else bos, else 0) to the longest; every text is cut to
`context_length` when one is given.

Example:
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc")  # a, b, c and <|endoftext|> (id 3), its bos
    >>> to_tokens(tok, "cab")
    tensor([[3, 2, 0, 1]])
    >>> to_tokens(tok, ["ab", "c"], prepend_bos=False)  # padded with the eos
    tensor([[0, 1],
            [2, 3]])
    >>> to_str_tokens(tok, "cab")
    ['<|endoftext|>', 'c', 'a', 'b']
    >>> to_string(tok, to_tokens(tok, "cab", prepend_bos=False)[0])
    'cab'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from glasslm.tokenizers import special_token_ids


def to_tokens(tokenizer: Any, text: str | Sequence[str], prepend_bos: bool | None = None,
              context_length: int | None = None) -> Int[Tensor, "batch seq"]:
    """(batch, seq) ids of one text or several; `prepend_bos` None or True puts the bos first where the
    tokenizer has one (TransformerLens's default), False never."""
    texts = [text] if isinstance(text, str) else list(text)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("to_tokens takes a text or a non-empty list of texts")
    roles = special_token_ids(tokenizer)
    bos = roles["bos"] if prepend_bos is not False else None
    rows = [([bos] if bos is not None else []) + list(tokenizer.encode(t)) for t in texts]
    if context_length is not None:
        rows = [row[:context_length] for row in rows]
    if not all(rows):
        raise ValueError("a text encodes to no tokens; give some text (or prepend_bos=True with a tokenizer that has a bos)")
    pad = next((i for i in (roles["pad"], roles["eos"], roles["bos"]) if i is not None), 0)
    width = max(map(len, rows))
    return torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=torch.long)


def to_str_tokens(tokenizer: Any, tokens: str | Sequence[str] | Tensor | Sequence[int],
                  prepend_bos: bool | None = None) -> list[str] | list[list[str]]:
    """Each token's own text: of a text (tokenized as `to_tokens` does), a list of texts (a list each),
    or ids (a 1-D tensor or list, or a (1, seq) tensor)."""
    if isinstance(tokens, str):
        tokens = to_tokens(tokenizer, tokens, prepend_bos)[0]
    elif isinstance(tokens, Sequence) and tokens and all(isinstance(t, str) for t in tokens):
        return [to_str_tokens(tokenizer, text, prepend_bos) for text in tokens]
    ids = torch.as_tensor(tokens).squeeze()
    if ids.dim() > 1:
        raise ValueError(f"to_str_tokens takes one sequence of ids, got shape {tuple(ids.shape)}")
    return [tokenizer.decode([int(i)]) for i in ids.reshape(-1)]


def to_string(tokenizer: Any, tokens: Tensor | Sequence[int]) -> str | list[str]:
    """The text of ids: one string for a 1-D sequence, one per row for a (batch, seq) tensor."""
    ids = torch.as_tensor(tokens)
    if ids.dim() > 2:
        raise ValueError(f"to_string takes (seq) or (batch, seq) ids, got shape {tuple(ids.shape)}")
    if ids.dim() == 2:
        return [tokenizer.decode(row.tolist()) for row in ids]
    return tokenizer.decode(ids.reshape(-1).tolist())

"""Constrained decoding: only tokens that keep the text inside a grammar (a JSON schema, any JSON
object, a Lark grammar) can be picked.

A grammar describes a set of texts. Before each token the matcher (llguidance's `LLMatcher`, a
compiled grammar plus a parser state) answers one question for every id of the vocabulary: if this
token's bytes came next, could the text still be completed inside the grammar? The answer is a
bitmask, one bit per id; the ids it rules out get logit -inf, and the token is sampled as usual from
what is left, with the same temperature and filters. The chosen token is then fed to the matcher,
which moves its parser state on. End-of-sequence is allowed exactly where the text so far is a
complete sentence of the grammar, and once nothing could follow (the closing brace of a JSON object)
the matcher says it is done.

So every finished answer is valid by construction, whatever the model or the temperature; the model
only chooses among valid continuations. It works on token ids, not characters: a token may carry
several characters ('{"' or '": ') and the mask admits it only if all of them fit. llguidance builds
the token table once per tokenizer (a trie of every token's bytes) and walks it with the grammar's
lexer for each mask, about 50 µs a token for JSON on the CPUs measured.

`Grammars` compiles grammars for one tokenizer and vocabulary; a `Grammar` is compiled once and
shared; each generated sequence gets its own `Matcher` (`Grammar.matcher()`). `GrammarError` (a
ValueError) names what is wrong with a schema or grammar, for a 400.

Example:
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text('{}":,0123456789ab ')  # the characters, then <|endoftext|>
    >>> grammars = Grammars(tok, vocab_size=tok.vocab_size, eos=[tok.special_tokens["<|endoftext|>"]])
    >>> schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
    ...           "additionalProperties": False}
    >>> matcher = grammars.json_schema(schema).matcher()
    >>> [tok.decode([i]) for i in matcher.allowed().nonzero()[:, 0].tolist()]  # the first token
    ['{']
    >>> for token in tok.encode('{"a": 12}'):
    ...     matcher.accept(token)
    >>> matcher.done
    True
    >>> grammars.json_schema({"type": "no-such-type"})
    Traceback (most recent call last):
    ...
    glasslm.generation.constrained.GrammarError: ...
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor

# JSON as the model writes it: compact (no free whitespace, which a sampled model could repeat until
# max_tokens), keys and values separated the usual way.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled, or uses a feature the grammar library lacks."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError("structured outputs need llguidance: pip install -e '.[serve]' "
                          "(or pip install llguidance)") from None
    return llguidance


class Grammars:
    """Compiles grammars over one tokenizer's ids (`vocab_size` rows, ids past the tokenizer never allowed).

    `eos` are the ids that may end a finished text. Building the token table takes a moment for a
    large vocabulary (about a second for 50k tokens), so it happens at the first grammar and is kept.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos: Sequence[int]):
        if not eos:
            raise ValueError("constrained decoding needs at least one end-of-sequence id")
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos)

    @functools.cached_property
    def lltokenizer(self) -> Any:
        """llguidance's token table: from the tokenizer.json where the tokenizer has one llguidance reads
        (byte-level and byte-fallback BPE), else from each id's bytes."""
        llg = _llguidance()
        backend = getattr(self.tokenizer, "backend", None)
        if backend is not None and hasattr(backend, "to_str"):
            try:
                return llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos)
            except ValueError:
                pass  # a decoder llguidance does not know (a char-level tokenizer.json): bytes per id below
        return llg.LLTokenizer(llg.TokenizerWrapper(_TokenTable(self.tokenizer, self.vocab_size, self.eos[0])),
                               n_vocab=self.vocab_size, eos_token=self.eos)

    def compile(self, grammar: str, what: str) -> Grammar:
        """A grammar in llguidance's serialized form, checked against this vocabulary."""
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if error:
            raise GrammarError(f"{what}: {error.strip()}")
        return Grammar(grammar, self)

    def json_schema(self, schema: dict[str, Any] | bool) -> Grammar:
        """The JSON texts `schema` accepts (JSON Schema: types, properties, required, enum, const,
        anyOf/oneOf/allOf, $ref within the schema, min/max lengths and values, patterns, formats)."""
        try:
            grammar = _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as err:
            raise GrammarError(f"the JSON schema cannot be compiled: {err}") from None
        return self.compile(grammar, "the JSON schema cannot be used")

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return self.json_schema({"type": "object"})

    def lark(self, source: str) -> Grammar:
        """The texts a Lark grammar (llguidance's dialect: `start: ...`, `%json {schema}`) accepts."""
        return self.compile(_llguidance().LLMatcher.grammar_from_lark(source), "the grammar cannot be used")


class Grammar:
    """A compiled grammar, shared by every sequence that follows it; `matcher()` starts one."""

    def __init__(self, serialized: str, grammars: Grammars):
        self.serialized, self.grammars = serialized, grammars

    def matcher(self) -> Matcher:
        llg = _llguidance()
        return Matcher(llg.LLMatcher(self.grammars.lltokenizer, self.serialized, log_level=0),
                       self.grammars.vocab_size, frozenset(self.grammars.eos))


class Matcher:
    """One sequence's position in a grammar: which tokens may come next, and what has come."""

    def __init__(self, matcher: Any, vocab_size: int, eos: frozenset[int]):
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, eos

    def allowed(self) -> Bool[Tensor, "vocab"]:
        """True for each id that keeps the text inside the grammar (eos where it may end here)."""
        return torch.from_numpy(self._bits())

    def _bits(self) -> np.ndarray:
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # bit i of the mask: id i
        return np.unpackbits(words, bitorder="little")[:self.vocab_size].view(bool)

    def constrain(self, logits: Float[Tensor, "1 vocab"]) -> Float[Tensor, "1 vocab"]:
        """`logits` with every id the grammar rules out at -inf.

        In numpy, one thread: a vocabulary-sized elementwise op is too small to split, and torch's
        threads would wait on cores that the decoding step and other processes hold (measured at ~10 ms
        for a 49k-row `any()` on 2 busy cores, against 50 µs here)."""
        allowed = self._bits()
        if not allowed.any():
            raise GrammarError(f"the grammar allows no next token ({self.matcher.get_error() or 'dead end'})")
        rows = logits.detach().cpu().numpy()
        return torch.from_numpy(np.where(allowed[:rows.shape[-1]], rows, np.float32("-inf"))).to(logits.device)

    def accept(self, token: int) -> None:
        """Move on past `token` (one `allowed` said yes to)."""
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not fit the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Nothing more can follow: the text is a finished sentence of the grammar."""
        return self.matcher.is_stopped()

    def ends(self, token: int) -> bool:
        """`token` is an end-of-sequence the grammar allowed here (the text is complete)."""
        return token in self.eos


class _TokenTable:
    """What llguidance's `TokenizerWrapper` reads from a tokenizer without a tokenizer.json it knows:
    each id's bytes (special tokens marked with a leading 0xFF, so they never match text), and encoding."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int):
        self.tokenizer = tokenizer
        specials = dict(getattr(tokenizer, "special_tokens", None) or {})
        self.special_token_ids = sorted(i for i in specials.values() if i < vocab_size)
        self.eos_token_id, self.bos_token_id = eos, None
        special = set(self.special_token_ids)
        known = min(vocab_size, tokenizer.vocab_size)
        self.tokens = [b"\xff" + _bytes_of(tokenizer, i) if i in special else _bytes_of(tokenizer, i)
                       for i in range(known)] + [b""] * (vocab_size - known)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("encodes text, not bytes")  # TokenizerWrapper then passes str
        return self.tokenizer.encode(text)


def _bytes_of(tokenizer: Any, token: int) -> bytes:
    """The bytes token `token` stands for (a byte-level BPE's own table, else its decoded text)."""
    if hasattr(tokenizer, "token_bytes"):
        return tokenizer.token_bytes(token)
    return tokenizer.decode([token]).encode("utf-8")

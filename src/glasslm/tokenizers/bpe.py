"""Byte-level BPE: `BPETokenizer` encodes and decodes with a vocabulary and an ordered list of
merges, trained here (`glasslm.tokenizers.trainer`) or GPT-2's released files (`glasslm.tokenizers.gpt2`).

Saved as `vocab.json` + `merges.txt` in GPT-2's own formats (Hugging Face's `GPT2TokenizerFast` /
`ByteLevelBPETokenizer` read them) and `glasslm_tokenizer.json`, a small descriptor
{"kind": "bpe", "name": ..., "special_tokens": {...}, ...}. Tokens are written as text through
GPT-2's byte -> character map (`bytes_to_unicode`).

Example:
    >>> vocab = {i: bytes([i]) for i in range(256)} | {256: b" w"}
    >>> tok = BPETokenizer(vocab, [(b" ", b"w")], special_tokens=[ENDOFTEXT])
    >>> tok.encode(" w<|endoftext|>"), tok.vocab_size
    ([256, 257], 258)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from pathlib import Path
from typing import Literal, get_args

from glasslm.tokenizers.base import BPE_DESCRIPTOR_FILE, ENDOFTEXT, MERGES_FILE, MERGES_HEADER, VOCAB_FILE
from glasslm.tokenizers import pretokens
from glasslm.tokenizers.pretokens import PRETOKEN_PATTERN, encode_with_specials, special_split_pattern

Backend = Literal["auto", "glasslm", "tiktoken"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
GPT2_NAME = "gpt2"  # the name of GPT-2's released vocabulary, for which backend="auto" picks tiktoken


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used in vocab.json / merges.txt.

    Bytes that are printable Latin-1 characters (other than space and soft hyphen) map to
    themselves; the other 68 bytes map, in byte order, to U+0100, U+0101, ... so every token is a
    string without spaces or control characters (the space byte becomes 'Ġ').

    Example:
        >>> m = bytes_to_unicode()
        >>> m[ord("a")], m[ord(" ")], m[ord("\\n")]
        ('a', 'Ġ', 'Ċ')
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class _PieceCache(dict):
    """pre-token (str) -> token ids (tuple); computes misses with `bpe` and empties itself when full.

    Emptying (rather than LRU bookkeeping) keeps hits at plain-dict speed; frequent pre-tokens come
    straight back after a reset.
    """

    def __init__(self, bpe, max_size: int):
        super().__init__()
        self._bpe = bpe
        self._max_size = max_size

    def __missing__(self, piece: str) -> tuple[int, ...]:
        ids = self._bpe(piece)
        if len(self) >= self._max_size:
            self.clear()
        self[piece] = ids
        return ids


class BPETokenizer:
    """Byte-level BPE encoder/decoder for a vocabulary and an ordered list of merges.

    Text is split at special tokens first (the longest wins where several overlap), the rest is
    cut into GPT-2 pre-tokens, and within each pre-token merges are applied lowest rank first.

    Args:
        vocab: id -> token bytes, ids exactly 0..n-1; all 256 single bytes must be present.
        merges: (left bytes, right bytes) pairs in priority order; each left+right must be in vocab.
        special_tokens: strings encoded as one id each; ones missing from `vocab` get new ids at the
            end. A mapping fixes the ids (they must hold the token's UTF-8 bytes in `vocab`).
        name: an optional label ("gpt2" for GPT-2's released vocabulary); saved with the files.
        backend: "glasslm" (pure Python, this class), "tiktoken" (tiktoken's Rust BPE built from
            this same vocabulary; identical ids for GPT-2, which the tests check), or "auto"
            (tiktoken when importable and `name == "gpt2"`).
        cache_size: how many distinct pre-tokens to remember (the cache empties when full).

    Example:
        >>> vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"<s>"}
        >>> tok = BPETokenizer(vocab, [(b"a", b"b")], special_tokens=["<s>"])
        >>> tok.encode("abc<s>")
        [256, 99, 257]
        >>> tok.decode([256, 99, 257])
        'abc<s>'
    """

    kind = "bpe"

    def __init__(
        self,
        vocab: Mapping[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Iterable[str] | Mapping[str, int] | None = None,
        *,
        name: str | None = None,
        backend: Backend = "glasslm",
        cache_size: int = 1 << 16,
    ):
        n = len(vocab)
        if sorted(vocab) != list(range(n)):
            raise ValueError("vocab ids must be exactly 0..len(vocab)-1")
        self._id_to_bytes: list[bytes] = [bytes(vocab[i]) for i in range(n)]
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.name = name
        self.special_tokens = self._register_specials(special_tokens or {})
        special_ids = set(self.special_tokens.values())
        # Non-special tokens by bytes (if bytes repeat, the lowest id is the one produced).
        self._bytes_to_id: dict[bytes, int] = {}
        for i, token in enumerate(self._id_to_bytes):
            if i not in special_ids:
                self._bytes_to_id.setdefault(token, i)
        missing = [b for b in range(256) if bytes([b]) not in self._bytes_to_id]
        if missing:
            raise ValueError(f"vocab lacks single-byte tokens for bytes {missing[:8]}...")
        self._byte_ids = [self._bytes_to_id[bytes([b])] for b in range(256)]  # byte value -> id
        self._ranks, self._merged_ids = self._index_merges()
        self._special_re = special_split_pattern(self.special_tokens)
        self._cache = _PieceCache(self._bpe, cache_size)
        self._tiktoken = None
        self.backend = self._choose_backend(backend)

    # ------------------------------------------------------------------ construction helpers

    def _register_specials(self, specials: Iterable[str] | Mapping[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        merged = {a + b for a, b in self.merges}
        if isinstance(specials, Mapping):
            for s, i in specials.items():
                if not 0 <= i < len(self._id_to_bytes) or self._id_to_bytes[i] != s.encode("utf-8"):
                    raise ValueError(f"special token {s!r}: id {i} does not hold its bytes in vocab")
                out[s] = int(i)
            return out
        for s in specials:
            if not isinstance(s, str) or not s:
                raise ValueError(f"special tokens must be non-empty strings, got {s!r}")
            if s in out:
                continue
            raw = s.encode("utf-8")
            # Reuse an id already holding these bytes unless the encoder needs that token for
            # ordinary text (a single byte or a merge result); otherwise append a new id.
            reusable = len(raw) > 1 and raw not in merged
            ids = [i for i, t in enumerate(self._id_to_bytes) if t == raw and i not in out.values()] if reusable else []
            if ids:
                out[s] = ids[-1]
            else:
                out[s] = len(self._id_to_bytes)
                self._id_to_bytes.append(raw)
        return out

    def _index_merges(self) -> tuple[dict[tuple[int, int], int], list[int]]:
        ranks: dict[tuple[int, int], int] = {}
        merged_ids: list[int] = []
        for rank, (a, b) in enumerate(self.merges):
            try:
                pair = (self._bytes_to_id[a], self._bytes_to_id[b])
                merged = self._bytes_to_id[a + b]
            except KeyError as err:
                raise ValueError(f"merge {rank} ({a!r}, {b!r}) uses a token missing from vocab: {err.args[0]!r}") from None
            ranks.setdefault(pair, rank)
            merged_ids.append(merged)
        return ranks, merged_ids

    def _choose_backend(self, backend: Backend) -> Backend:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
        if backend == "glasslm" or (backend == "auto" and self.name != GPT2_NAME):
            return "glasslm"
        try:
            self._tiktoken = self._build_tiktoken()
        except ImportError:
            if backend == "tiktoken":
                raise ImportError("backend='tiktoken' needs the tiktoken package (pip install tiktoken)") from None
            return "glasslm"
        return "tiktoken"

    def _build_tiktoken(self):
        """A tiktoken Encoding over this vocabulary (rank = id), built locally: no download."""
        import tiktoken

        special_ids = set(self.special_tokens.values())
        ranks = {t: i for i, t in enumerate(self._id_to_bytes) if i not in special_ids}
        if len(ranks) != len(self._id_to_bytes) - len(special_ids):
            raise ValueError("tiktoken backend needs distinct token bytes")
        return tiktoken.Encoding(
            name=f"glasslm-{self.name or 'bpe'}",
            pat_str=PRETOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={},  # specials are split out here, with longest-match semantics
        )

    # ------------------------------------------------------------------ sizes

    @property
    def vocab_size(self) -> int:
        """Number of ids (all ids are < vocab_size)."""
        return len(self._id_to_bytes)

    def token_bytes(self, i: int) -> bytes:
        """The bytes of token `i` (a special token's UTF-8 bytes for special ids)."""
        return self._id_to_bytes[i]

    # ------------------------------------------------------------------ encoding

    def _bpe(self, piece: str) -> tuple[int, ...]:
        """Token ids for one pre-token: start from its bytes, apply the best-ranked merge until none applies."""
        ids = [self._byte_ids[b] for b in piece.encode("utf-8")]
        get_rank = self._ranks.get
        none = len(self._merged_ids)  # larger than every rank
        while len(ids) > 1:
            best, best_pair = none, None
            for pair in zip(ids, ids[1:]):
                r = get_rank(pair, none)
                if r < best:
                    best, best_pair = r, pair
            if best_pair is None:
                break
            a, b = best_pair
            new = self._merged_ids[best]
            out, i, n = [], 0, len(ids)
            while i < n:
                if ids[i] == a and i + 1 < n and ids[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            ids = out
        return tuple(ids)

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode treating special-token strings as ordinary text.

        Example:
            >>> tok = BPETokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<s>"])
            >>> tok.encode_ordinary("<s>"), tok.encode("<s>")
            ([60, 115, 62], [256])
        """
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        return list(chain.from_iterable(map(self._cache.__getitem__, pretokens.PRETOKEN_RE.findall(text))))

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`; special tokens become their single ids (longest match wins)."""
        return encode_with_specials(text, self._special_re, self.special_tokens, self.encode_ordinary)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """`encode` of each text; with the tiktoken backend, the texts holding no special token are
        encoded by tiktoken's threads (`num_threads`; its Rust core releases the GIL).

        Example:
            >>> tok = BPETokenizer({i: bytes([i]) for i in range(256)} | {256: b"ab"}, [(b"a", b"b")], ["<s>"])
            >>> tok.encode_batch(["xab", "a<s>b"])
            [[120, 256], [97, 257, 98]]
        """
        texts = list(texts)
        if self._tiktoken is None:
            return [self.encode(t) for t in texts]
        special = [self._special_re is not None and self._special_re.search(t) is not None for t in texts]
        plain = [t for t, s in zip(texts, special) if not s]
        encoded = iter(self._tiktoken.encode_ordinary_batch(plain, num_threads=num_threads) if plain else [])
        return [self.encode(t) if s else next(encoded) for t, s in zip(texts, special)]

    def encode_iterable(self, chunks: Iterable[str], flush_chars: int = 1 << 14) -> Iterator[int]:
        """Lazily encode a stream of text chunks (e.g. an open file's lines) in bounded memory.

        Gives exactly `encode("".join(chunks))`. Text is buffered until `flush_chars` characters,
        then everything before the last safe cut is encoded and the remainder kept for the next
        round (see `_encode_settled`), so pre-tokens and special tokens straddling chunk edges
        are handled. Memory stays about `flush_chars` + the largest chunk + the longest pre-token.

        Example:
            >>> tok = BPETokenizer({i: bytes([i]) for i in range(256)} | {256: b"ab"}, [(b"a", b"b")])
            >>> list(tok.encode_iterable(["xa", "b", "y"]))
            [120, 256, 121]
        """
        pending: list[str] = []
        size, limit = 0, flush_chars
        for chunk in chunks:
            pending.append(chunk)
            size += len(chunk)
            if size < limit:
                continue
            buf = "".join(pending)
            ids, cut = self._encode_settled(buf)
            yield from ids
            rest = buf[cut:]
            pending, size = [rest], len(rest)
            # A huge unbroken pre-token: wait for more text instead of re-scanning every chunk.
            limit = max(flush_chars, 2 * size)
        if pending:
            yield from self.encode("".join(pending))

    def _encode_settled(self, buf: str) -> tuple[list[int], int]:
        """(ids, c): the ids of buf[:c] for a c such that no later text can change them, i.e.
        encode(buf + more) == ids + encode(buf[c:] + more) for any `more`.

        Special tokens are only trusted when they start `longest special` characters before the
        end (more text could still extend them); cutting right after one is always safe. After
        the last trusted special token, prefer cutting after a newline between printable ASCII
        characters (see `glasslm.tokenizers.trainer.safe_cut_pattern`). Failing that, pre-tokenize up to a
        horizon and keep the pre-tokens that end at least 2 characters before it: the GPT-2
        pattern decides a pre-token from at most 3 characters after its start and 1 after its
        end. Those pre-tokens are encoded as they are, not re-split: cut off from its context,
        the text before the cut could pre-tokenize differently (" \n" alone is one pre-token).
        """
        longest = max(map(len, self.special_tokens), default=0)
        horizon = len(buf) - longest - 4  # nothing at or after this is settled
        if horizon <= 0:
            return [], 0
        start = 0
        if self._special_re is not None:
            for match in self._special_re.finditer(buf, 0, len(buf)):
                if match.start() >= horizon:
                    break
                start = match.end()
            if start >= horizon:
                return self.encode(buf[:start]), start
        q = buf.rfind("\n", start + 1, horizon - 1)
        while q > start:
            if "!" <= buf[q - 1] <= "~" and "!" <= buf[q + 1] <= "~":
                return self.encode(buf[: q + 1]), q + 1
            q = buf.rfind("\n", start + 1, q)
        pieces = pretokens.PRETOKEN_RE.findall(buf, start, horizon)
        end = horizon
        while pieces and end > horizon - 2:
            end -= len(pieces.pop())
        return self.encode(buf[:start]) + self._encode_pieces(pieces), max(end, start)

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        """Ids for text already cut into pre-tokens (each pre-token re-splits to itself)."""
        if self._tiktoken is not None:
            return list(chain.from_iterable(map(self._tiktoken.encode_ordinary, pieces)))
        return list(chain.from_iterable(map(self._cache.__getitem__, pieces)))

    # ------------------------------------------------------------------ decoding

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes for `ids`; raises ValueError for ids outside the vocabulary."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        n = len(self._id_to_bytes)
        try:
            if ids and (min(ids) < 0 or max(ids) >= n):
                bad = next(i for i in ids if not 0 <= i < n)
                raise ValueError(f"token id {bad} is outside the vocabulary (size {n})")
            return b"".join(map(self._id_to_bytes.__getitem__, ids))
        except TypeError:
            raise ValueError("token ids must be integers") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text for `ids`; byte sequences that are not valid UTF-8 become U+FFFD, never an error.

        Example:
            >>> tok = BPETokenizer({i: bytes([i]) for i in range(256)}, [])
            >>> tok.decode([104, 105, 0xE2, 0x82])
            'hi�'
        """
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ files

    @classmethod
    def from_gpt2_files(
        cls,
        vocab_file: str | os.PathLike,
        merges_file: str | os.PathLike,
        special_tokens: Iterable[str] | Mapping[str, int] | None = (ENDOFTEXT,),
        **kwargs,
    ) -> "BPETokenizer":
        """Load GPT-2-format files: `vocab.json`/`encoder.json` and `merges.txt`/`vocab.bpe`.

        Special tokens listed here that appear in the vocab file keep their ids there (GPT-2's
        `<|endoftext|>` is 50256); a missing one is appended.
        """
        specials = special_tokens or ()
        vocab = read_gpt2_vocab(vocab_file, set(specials))
        return cls(vocab, read_gpt2_merges(merges_file), specials, **kwargs)

    def to_dict(self) -> dict:
        """The descriptor saved as `glasslm_tokenizer.json`."""
        return {
            "kind": self.kind,
            "name": self.name,
            "format": "gpt2-vocab-merges",
            "vocab_file": VOCAB_FILE,
            "merges_file": MERGES_FILE,
            "special_tokens": self.special_tokens,
            "pattern": PRETOKEN_PATTERN,
        }

    def save(self, directory: str | os.PathLike) -> None:
        """Write `vocab.json`, `merges.txt` (GPT-2 formats) and `glasslm_tokenizer.json`."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / VOCAB_FILE).write_text(json.dumps(gpt2_vocab(self), ensure_ascii=False), encoding="utf-8")
        lines = [MERGES_HEADER] + [f"{token_text(a)} {token_text(b)}" for a, b in self.merges]
        (path / MERGES_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
        (path / BPE_DESCRIPTOR_FILE).write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")

    @classmethod
    def load(cls, directory: str | os.PathLike, backend: Backend | None = None) -> "BPETokenizer":
        """Read a directory written by `save`."""
        path = Path(directory)
        meta = json.loads((path / BPE_DESCRIPTOR_FILE).read_text(encoding="utf-8"))
        if meta.get("pattern", PRETOKEN_PATTERN) != PRETOKEN_PATTERN:
            raise ValueError(f"{path}: saved with an unsupported pre-tokenizer pattern")
        name = meta.get("name")
        backend = backend or ("auto" if name == GPT2_NAME else "glasslm")
        return cls.from_gpt2_files(
            path / meta.get("vocab_file", VOCAB_FILE),
            path / meta.get("merges_file", MERGES_FILE),
            {s: int(i) for s, i in meta.get("special_tokens", {}).items()},
            name=name,
            backend=backend,
        )


# --------------------------------------------------------------------------- GPT-2's file formats

_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def token_text(token: bytes) -> str:
    """A token's bytes as GPT-2's files write them (`bytes_to_unicode`, byte by byte).

    Example:
        >>> token_text(b" the")
        'Ġthe'
    """
    return "".join(map(_BYTE_TO_CHAR.__getitem__, token))


def text_token(text: str, where: str) -> bytes:
    """The bytes of a token written by `token_text` (`where` names the file in errors)."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in text)
    except KeyError as err:
        raise ValueError(f"{where}: {text!r} has a character outside GPT-2's byte alphabet: {err.args[0]!r}") from None


def gpt2_vocab(tokenizer: BPETokenizer) -> dict[str, int]:
    """The `vocab.json` mapping (token text -> id); special tokens are written verbatim."""
    special_ids = {i: s for s, i in tokenizer.special_tokens.items()}
    vocab: dict[str, int] = {}
    for i in range(tokenizer.vocab_size):
        key = special_ids.get(i) or token_text(tokenizer.token_bytes(i))
        if key in vocab:
            raise ValueError(f"tokens {vocab[key]} and {i} have the same text {key!r}: one vocabulary file cannot hold both")
        vocab[key] = i
    return vocab


def read_gpt2_vocab(vocab_file: str | os.PathLike, special_tokens: Iterable[str] = ()) -> dict[int, bytes]:
    """id -> bytes from `vocab.json` / `encoder.json`; the named special tokens are read verbatim."""
    with open(vocab_file, encoding="utf-8") as f:
        encoder = json.load(f)
    special_names = set(special_tokens)
    return {int(i): token.encode("utf-8") if token in special_names else text_token(token, str(vocab_file))
            for token, i in encoder.items()}


def read_gpt2_merges(merges_file: str | os.PathLike) -> list[tuple[bytes, bytes]]:
    """The merges of `merges.txt` / `vocab.bpe` in rank order (an optional `#version` line first)."""
    merges = []
    with open(merges_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            where = f"{merges_file}:{lineno}"
            if len(parts) != 2:
                raise ValueError(f"{where}: expected two tokens separated by a space, got {line!r}")
            merges.append((text_token(parts[0], where), text_token(parts[1], where)))
    return merges

"""Tokenizers: text <-> token ids, all behind one small interface (`Tokenizer`).

Every tokenizer has `vocab_size`, `special_tokens` (str -> id), `encode(text) -> list[int]`,
`decode(ids) -> str`, `encode_iterable(chunks) -> Iterator[int]` and `save(directory)`;
`load_tokenizer(directory)` reads back whatever `save` wrote.

Kinds:
    * `CharTokenizer`: one id per character seen in the training text.
    * `BPETokenizer`: byte-level BPE, either trained here (`train_tokenizer`, `glasslm.tokenizers.trainer`) or
      GPT-2's released vocabulary (`gpt2_tokenizer`), optionally encoding through tiktoken.
    * `HFTokenizer`: any Hugging Face `tokenizer.json` (byte-level BPE, Llama-style BPE with byte
      fallback, WordPiece, ...) run by the `tokenizers` library, with its special and added tokens.
    * `SentencePieceTokenizer`: a SentencePiece `tokenizer.model` (needs the sentencepiece package).

`to_hf_json(tokenizer)` writes any of them as a `tokenizer.json` that `tokenizers` and
`transformers.AutoTokenizer` load and that encodes to the same ids (used by export).

Files written by `save(directory)`:
    * char: `tokenizer.json` = {"kind": "char", "chars": [...]} (told apart from a Hugging Face
      `tokenizer.json` by its "kind" key).
    * bpe:  `vocab.json` + `merges.txt` in GPT-2's own formats (so Hugging Face's
      `GPT2TokenizerFast` / `ByteLevelBPETokenizer` read them), and `glasslm_tokenizer.json`, a
      small descriptor {"kind": "bpe", "name": ..., "special_tokens": {...}, ...}. It is not called
      `tokenizer.json` because Hugging Face loaders treat that name as their own full format.

Example:
    >>> tok = CharTokenizer.from_text("hello world")
    >>> tok.decode(tok.encode("hello"))
    'hello'
    >>> bpe = train_tokenizer_from_text("the cat sat on the mat " * 20, vocab_size=270)
    >>> bpe.decode(bpe.encode("the rat<|endoftext|>"))
    'the rat<|endoftext|>'
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from pathlib import Path
from typing import Protocol, runtime_checkable

from glasslm.locations import DATA_DIR_RULE
from glasslm.locations import data_dir as resolve_data_dir
from glasslm.tokenizers.trainer import PRETOKEN_PATTERN, PRETOKEN_RE, special_split_pattern, train_bpe

TOKENIZER_FILE = "tokenizer.json"  # CharTokenizer's descriptor (name kept for old checkpoints)
BPE_DESCRIPTOR_FILE = "glasslm_tokenizer.json"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
MERGES_HEADER = "#version: 0.2"
ENDOFTEXT = "<|endoftext|>"

# SHA-256 of GPT-2's released files (encoder.json; vocab.bpe with and without its header line).
GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "vocab.bpe (no header)": "ac33235097fe06d4a8fff0feac994644809e6eb6ab70669e1e9fd40ae032428e",
}


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


# =========================================================================== characters


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


# =========================================================================== byte-level BPE


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
        backend: str = "glasslm",
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

    def _choose_backend(self, backend: str) -> str:
        if backend not in ("auto", "glasslm", "tiktoken"):
            raise ValueError(f"backend must be 'auto', 'glasslm' or 'tiktoken', got {backend!r}")
        if backend == "glasslm" or (backend == "auto" and self.name != "gpt2"):
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
        return list(chain.from_iterable(map(self._cache.__getitem__, PRETOKEN_RE.findall(text))))

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`; special tokens become their single ids (longest match wins)."""
        if self._special_re is None:
            return self.encode_ordinary(text)
        out: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):
            if match.start() > pos:
                out += self.encode_ordinary(text[pos : match.start()])
            out.append(self.special_tokens[match.group()])
            pos = match.end()
        if pos < len(text):
            out += self.encode_ordinary(text[pos:])
        return out

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
        pieces = PRETOKEN_RE.findall(buf, start, horizon)
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
        decoder = {c: b for b, c in bytes_to_unicode().items()}

        def to_bytes(token: str, where: str) -> bytes:
            try:
                return bytes(decoder[c] for c in token)
            except KeyError as err:
                raise ValueError(f"{where}: {token!r} has a character outside GPT-2's byte alphabet: {err.args[0]!r}") from None

        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
        specials = special_tokens or ()
        special_names = set(specials)
        vocab: dict[int, bytes] = {}
        for token, i in encoder.items():
            # Special tokens are stored verbatim (e.g. "<|endoftext|>"), not byte-mapped.
            vocab[int(i)] = token.encode("utf-8") if token in special_names else to_bytes(token, str(vocab_file))
        merges = []
        with open(merges_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line or (lineno == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"{merges_file}:{lineno}: expected two tokens separated by a space, got {line!r}")
                merges.append((to_bytes(parts[0], f"{merges_file}:{lineno}"), to_bytes(parts[1], f"{merges_file}:{lineno}")))
        return cls(vocab, merges, specials, **kwargs)

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
        mapping = bytes_to_unicode()
        special_ids = {i: s for s, i in self.special_tokens.items()}

        def to_str(token: bytes) -> str:
            return "".join(mapping[b] for b in token)

        encoder: dict[str, int] = {}
        for i, token in enumerate(self._id_to_bytes):
            key = special_ids.get(i, to_str(token))
            if key in encoder:
                raise ValueError(f"cannot save: tokens {encoder[key]} and {i} have the same text {key!r}")
            encoder[key] = i
        (path / VOCAB_FILE).write_text(json.dumps(encoder, ensure_ascii=False), encoding="utf-8")
        lines = [MERGES_HEADER] + [f"{to_str(a)} {to_str(b)}" for a, b in self.merges]
        (path / MERGES_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
        (path / BPE_DESCRIPTOR_FILE).write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")

    @classmethod
    def load(cls, directory: str | os.PathLike, backend: str | None = None) -> "BPETokenizer":
        """Read a directory written by `save`."""
        path = Path(directory)
        meta = json.loads((path / BPE_DESCRIPTOR_FILE).read_text(encoding="utf-8"))
        if meta.get("pattern", PRETOKEN_PATTERN) != PRETOKEN_PATTERN:
            raise ValueError(f"{path}: saved with an unsupported pre-tokenizer pattern")
        name = meta.get("name")
        backend = backend or ("auto" if name == "gpt2" else "glasslm")
        return cls.from_gpt2_files(
            path / meta.get("vocab_file", VOCAB_FILE),
            path / meta.get("merges_file", MERGES_FILE),
            {s: int(i) for s, i in meta.get("special_tokens", {}).items()},
            name=name,
            backend=backend,
        )


# =========================================================================== GPT-2


_GPT2_NAMES = [("gpt2_vocab.json", "gpt2_merges.txt"), ("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt")]


def find_gpt2_files(data_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Locate GPT-2's vocab and merges files: in the data directory (`data_dir`, else
    $GLASSLM_DATA_DIR, else ~/.cache/glasslm) or its
    `gpt2/` subdirectory, named gpt2_vocab.json + gpt2_merges.txt, encoder.json + vocab.bpe, or
    vocab.json + merges.txt. Raises FileNotFoundError saying what to put where."""
    root = resolve_data_dir(data_dir)  # the one rule: data_dir, else $GLASSLM_DATA_DIR, else ~/.cache/glasslm
    for folder in (root / "gpt2", root):
        for vocab_name, merges_name in _GPT2_NAMES:
            if (folder / vocab_name).is_file() and (folder / merges_name).is_file():
                return folder / vocab_name, folder / merges_name
    raise FileNotFoundError(
        f"GPT-2 tokenizer files not found under {root}: expected {root / 'gpt2' / 'gpt2_vocab.json'} and "
        f"{root / 'gpt2' / 'gpt2_merges.txt'} (GPT-2's encoder.json and vocab.bpe; the names "
        f"encoder.json/vocab.bpe or vocab.json/merges.txt also work, in gpt2/ or directly in the directory; "
        f"data directory: {DATA_DIR_RULE})"
    )


def gpt2_tokenizer(data_dir: str | os.PathLike | None = None, backend: str = "auto") -> BPETokenizer:
    """GPT-2's tokenizer (50257 ids, `<|endoftext|>` = 50256) from local files, no download.

    `backend="auto"` encodes with tiktoken when it is installed (same ids, ~3x faster), else with
    glasslm's own encoder; "glasslm" or "tiktoken" force one.

    Example (needs the files; see `find_gpt2_files`):
        >>> tok = gpt2_tokenizer(backend="glasslm")  # doctest: +SKIP
        >>> tok.encode("Hello world<|endoftext|>")  # doctest: +SKIP
        [15496, 995, 50256]
    """
    vocab_file, merges_file = find_gpt2_files(data_dir)
    return BPETokenizer.from_gpt2_files(vocab_file, merges_file, (ENDOFTEXT,), name="gpt2", backend=backend)


# =========================================================================== Hugging Face files

HF_TOKENIZER_FILE = "tokenizer.json"  # the same name as the char descriptor: told apart by its keys
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
SPM_FILE = "tokenizer.model"
SPECIAL_ROLES = ("bos", "eos", "pad", "unk")
# Names a BPE vocabulary uses for its start/end of text, in order of preference.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|im_start|>", ENDOFTEXT)
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|im_end|>", ENDOFTEXT)


def _tokenizers_lib():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("Hugging Face tokenizer files need the tokenizers package: pip install tokenizers") from None
    return tokenizers


def _token_text(value) -> str | None:
    """A tokenizer_config.json role value: a string, an AddedToken-like dict, or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, run by the `tokenizers` library (Rust), behind glasslm's interface.

    `encode` adds no special tokens (glasslm's convention, and `AutoTokenizer`'s with
    `add_special_tokens=False`); special and added tokens written in the text still become their
    single ids. `config` is the directory's `tokenizer_config.json` (which token is bos/eos/pad);
    it is written back unchanged by `save`.

    Example:
        >>> tok = HFTokenizer.from_json(to_hf_json(CharTokenizer.from_text("abc")))
        >>> tok.encode("cab"), tok.decode([2, 0, 1])
        ([2, 0, 1], 'cab')
    """

    kind = "hf"

    def __init__(self, backend, config: Mapping | None = None):
        self.backend = backend  # a tokenizers.Tokenizer
        self.config = dict(config or {})
        added = backend.get_added_tokens_decoder()
        self.special_tokens: dict[str, int] = {t.content: int(i) for i, t in sorted(added.items()) if t.special}

    @classmethod
    def from_json(cls, data: Mapping | str, config: Mapping | None = None) -> "HFTokenizer":
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        try:
            backend = _tokenizers_lib().Tokenizer.from_str(text)
        except Exception as err:  # the Rust side raises plain Exceptions
            raise ValueError(f"not a Hugging Face tokenizer.json the tokenizers library can read: {err}") from None
        return cls(backend, config)

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> "HFTokenizer":
        root = Path(directory)
        config_path = root / HF_TOKENIZER_CONFIG
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        try:
            return cls.from_json((root / HF_TOKENIZER_FILE).read_text(encoding="utf-8"), config)
        except ValueError as err:
            raise ValueError(f"{root / HF_TOKENIZER_FILE}: {err}") from None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_iterable(self, chunks: Iterable[str]) -> Iterator[int]:
        # A general tokenizer.json has no cut point known to be safe, so the text is encoded whole.
        yield from self.encode("".join(chunks))

    def decode(self, ids: Iterable[int]) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=False)

    def role_ids(self) -> dict[str, int | None]:
        """{"bos": id, "eos": id, "pad": id, "unk": id} as tokenizer_config.json names them (None if not)."""
        out: dict[str, int | None] = {}
        for role in SPECIAL_ROLES:
            text = _token_text(self.config.get(f"{role}_token"))
            out[role] = self.backend.token_to_id(text) if text is not None else None
        return out

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / HF_TOKENIZER_FILE).write_text(self.backend.to_str(), encoding="utf-8")
        (path / HF_TOKENIZER_CONFIG).write_text(json.dumps(self.config, indent=2, ensure_ascii=False), encoding="utf-8")


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
        root = Path(directory)
        config_path = root / HF_TOKENIZER_CONFIG
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        return cls((root / SPM_FILE).read_bytes(), config)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_iterable(self, chunks: Iterable[str]) -> Iterator[int]:
        yield from self.encode("".join(chunks))

    def decode(self, ids: Iterable[int]) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        return self.sp.decode(ids)

    def role_ids(self) -> dict[str, int | None]:
        ids = {"bos": self.sp.bos_id(), "eos": self.sp.eos_id(), "pad": self.sp.pad_id(), "unk": self.sp.unk_id()}
        return {role: (i if i >= 0 else None) for role, i in ids.items()}

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / SPM_FILE).write_bytes(self.model_bytes)
        (path / HF_TOKENIZER_CONFIG).write_text(json.dumps(self.config, indent=2, ensure_ascii=False), encoding="utf-8")


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """Which ids are bos / eos / pad / unk for any glasslm tokenizer (None where it has none).

    A character tokenizer has none. A BPE vocabulary's `<|endoftext|>` is both bos and eos, as in
    GPT-2; `<s>`/`</s>` and Llama 3's names are recognised too. Hugging Face and SentencePiece
    tokenizers say themselves.

    Example:
        >>> special_token_ids(CharTokenizer.from_text("ab"))
        {'bos': None, 'eos': None, 'pad': None, 'unk': None}
    """
    if tokenizer is None or isinstance(tokenizer, CharTokenizer):
        return {role: None for role in SPECIAL_ROLES}
    if hasattr(tokenizer, "role_ids"):
        return tokenizer.role_ids()
    specials = tokenizer.special_tokens
    bos = next((specials[n] for n in _BOS_NAMES if n in specials), None)
    eos = next((specials[n] for n in _EOS_NAMES if n in specials), None)
    return {"bos": bos, "eos": eos, "pad": None, "unk": None}


def same_vocabulary(a, b) -> bool:
    """True if two tokenizers give every text the same ids (compared through their tokenizer.json
    models and special tokens; kinds that cannot be written as one, by kind, size and specials)."""
    if a is b:
        return True
    try:
        ja, jb = to_hf_json(a), to_hf_json(b)
    except ValueError:
        return (type(a) is type(b) and a.vocab_size == b.vocab_size and a.special_tokens == b.special_tokens
                and getattr(a, "model_bytes", None) == getattr(b, "model_bytes", None))
    specials = lambda j: sorted((t["id"], t["content"]) for t in j.get("added_tokens") or [])  # noqa: E731
    keys = ("model", "normalizer", "pre_tokenizer")
    return all(ja.get(k) == jb.get(k) for k in keys) and specials(ja) == specials(jb)


def _added_token(content: str, i: int) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def to_hf_json(tokenizer) -> dict:
    """A Hugging Face `tokenizer.json` (as a dict) that encodes exactly as `tokenizer` does.

    * char: a WordLevel model over the characters, after a pre-tokenizer that isolates every
      character, decoded by fusing the characters back together (no spaces added).
    * byte-level BPE (ours or GPT-2's): a BPE model over GPT-2's byte alphabet with the same
      merges, GPT-2's pre-tokenizer regex, and the special tokens as added tokens.
    * an `HFTokenizer`: its own JSON.
    A SentencePiece tokenizer is not converted (it is saved as its tokenizer.model).
    """
    if isinstance(tokenizer, HFTokenizer):
        return json.loads(tokenizer.backend.to_str())
    if isinstance(tokenizer, CharTokenizer):
        return {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            # [\s\S] is any one character, newlines included: each character becomes its own piece.
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": False},
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": {c: i for i, c in enumerate(tokenizer.chars)},
                      "unk_token": "<unk>"},
        }
    if isinstance(tokenizer, BPETokenizer):
        mapping = bytes_to_unicode()
        special_ids = {i: s for s, i in tokenizer.special_tokens.items()}

        def to_str(token: bytes) -> str:
            return "".join(mapping[b] for b in token)

        vocab: dict[str, int] = {}
        for i in range(tokenizer.vocab_size):
            key = special_ids.get(i, to_str(tokenizer.token_bytes(i)))
            if key in vocab:
                raise ValueError(f"cannot export: tokens {vocab[key]} and {i} have the same text {key!r}")
            vocab[key] = i
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [_added_token(s, i) for s, i in sorted(tokenizer.special_tokens.items(), key=lambda x: x[1])],
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [[to_str(a), to_str(b)] for a, b in tokenizer.merges]},
        }
    raise ValueError(f"cannot write a {getattr(tokenizer, 'kind', type(tokenizer).__name__)} tokenizer as tokenizer.json")


def hf_tokenizer_config(tokenizer, context_length: int | None = None) -> dict:
    """`tokenizer_config.json` for `to_hf_json(tokenizer)`: the class AutoTokenizer should build and
    which tokens are bos/eos/pad/unk (only those the tokenizer really has). An `HFTokenizer` or
    `SentencePieceTokenizer` keeps the config it was read with."""
    if isinstance(tokenizer, (HFTokenizer, SentencePieceTokenizer)) and tokenizer.config:
        return dict(tokenizer.config)
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    names = {i: s for s, i in getattr(tokenizer, "special_tokens", {}).items()}
    for role, i in special_token_ids(tokenizer).items():
        if i is not None and i in names:
            config[f"{role}_token"] = names[i]
    if context_length is not None:
        config["model_max_length"] = context_length
    return config


def save_hf_tokenizer(tokenizer, directory: str | os.PathLike, context_length: int | None = None) -> None:
    """Write `tokenizer` as files `transformers.AutoTokenizer.from_pretrained(directory)` loads."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, SentencePieceTokenizer):
        tokenizer.save(path)
        return
    (path / HF_TOKENIZER_FILE).write_text(json.dumps(to_hf_json(tokenizer), ensure_ascii=False, indent=2), encoding="utf-8")
    config = hf_tokenizer_config(tokenizer, context_length)
    (path / HF_TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def read_hf_tokenizer(directory: str | os.PathLike):
    """The tokenizer of a Hugging Face model directory, or None if it has no tokenizer files.

    Looks for `tokenizer.json` (any model the tokenizers library runs), then SentencePiece's
    `tokenizer.model`, then GPT-2's `vocab.json` + `merges.txt`.
    """
    root = Path(directory)
    if (root / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer.from_directory(root)
    if (root / SPM_FILE).is_file():
        return SentencePieceTokenizer.from_directory(root)
    if (root / VOCAB_FILE).is_file() and (root / MERGES_FILE).is_file():
        return BPETokenizer.from_gpt2_files(root / VOCAB_FILE, root / MERGES_FILE)
    return None


# =========================================================================== training, loading


def train_tokenizer(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    vocab_size: int,
    special_tokens: Sequence[str] = (ENDOFTEXT,),
    out_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on UTF-8 text files and (if `out_dir`) save it there.

    `paths` are file names (plain strings here mean paths). See `glasslm.tokenizers.trainer.train_bpe`.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "a.txt").write_text("to be or not to be " * 50)
        >>> tok = train_tokenizer([d / "a.txt"], vocab_size=300, out_dir=d / "tok")
        >>> load_tokenizer(d / "tok").encode("to be") == tok.encode("to be")
        True
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    vocab, merges = train_bpe([Path(p) for p in paths], vocab_size, special_tokens, num_workers)
    tok = BPETokenizer(vocab, merges, list(special_tokens))
    if out_dir is not None:
        tok.save(out_dir)
    return tok


def train_tokenizer_from_text(text: str, vocab_size: int, special_tokens: Sequence[str] = (ENDOFTEXT,)) -> BPETokenizer:
    """Like `train_tokenizer`, for text already in memory (handy in tests and notebooks)."""
    vocab, merges = train_bpe(text=text, vocab_size=vocab_size, special_tokens=special_tokens, num_workers=1)
    return BPETokenizer(vocab, merges, list(special_tokens))


def load_tokenizer(directory: str | os.PathLike) -> "CharTokenizer | BPETokenizer | HFTokenizer | SentencePieceTokenizer":
    """Read the tokenizer that `save(directory)` wrote (any kind).

    Looks for `glasslm_tokenizer.json` (BPE) first, then `tokenizer.json` (char, or a Hugging
    Face tokenizer.json), then SentencePiece's `tokenizer.model`.
    """
    root = Path(directory)
    if (root / BPE_DESCRIPTOR_FILE).is_file():
        path = root / BPE_DESCRIPTOR_FILE
    else:
        path = root / TOKENIZER_FILE
    if not path.is_file() and (root / SPM_FILE).is_file():
        return SentencePieceTokenizer.from_directory(root)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer found: neither {root / BPE_DESCRIPTOR_FILE} nor {root / TOKENIZER_FILE} exists")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "char":
        chars = data.get("chars")
        if not isinstance(chars, list) or not chars or not all(isinstance(c, str) for c in chars):
            raise ValueError(f"{path}: a character tokenizer needs \"chars\", a list of its characters; "
                             f"got {type(chars).__name__ if chars is not None else 'none'}")
        return CharTokenizer(chars)
    if kind == "bpe":
        return BPETokenizer.load(root)
    if kind is None and isinstance(data, dict) and "model" in data:
        return HFTokenizer.from_directory(root)  # a Hugging Face tokenizer.json
    raise ValueError(f"{path}: unknown tokenizer kind {kind!r}")


def get_tokenizer(
    spec: str | os.PathLike,
    *,
    text: str | None = None,
    data_dir: str | os.PathLike | None = None,
    backend: str = "auto",
) -> CharTokenizer | BPETokenizer:
    """Make a tokenizer from a short spec.

    * "char": a `CharTokenizer` over the characters of `text` (required).
    * "gpt2": GPT-2's tokenizer from local files (see `gpt2_tokenizer`; `data_dir`, `backend`).
    * a directory written by a tokenizer's `save`.

    Example:
        >>> get_tokenizer("char", text="abc").vocab_size
        3
    """
    if spec == "char":
        if text is None:
            raise ValueError("get_tokenizer('char') needs the text to take characters from: text=...")
        return CharTokenizer.from_text(text)
    if spec == "gpt2":
        return gpt2_tokenizer(data_dir, backend=backend)
    if Path(spec).is_dir():
        return load_tokenizer(spec)
    raise ValueError(f"unknown tokenizer {str(spec)!r}: use 'char', 'gpt2' or a saved tokenizer directory")

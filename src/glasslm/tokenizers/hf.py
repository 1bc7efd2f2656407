"""Hugging Face tokenizer files, both ways: `HFTokenizer` runs any `tokenizer.json` (byte-level
BPE, Llama-style BPE with byte fallback, WordPiece, ...) with the `tokenizers` library;
`to_hf_json` / `save_hf_tokenizer` write any glasslm tokenizer as a `tokenizer.json` +
`tokenizer_config.json` that `transformers.AutoTokenizer` loads and that encodes to the same ids;
`read_hf_tokenizer` reads whichever tokenizer files a Hugging Face model directory has.

Example:
    >>> from glasslm.tokenizers.char import CharTokenizer
    >>> char = CharTokenizer.from_text("hello")
    >>> HFTokenizer.from_json(to_hf_json(char)).encode("hole") == char.encode("hole")
    True
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from glasslm.tokenizers.base import (
    ENDOFTEXT, HF_TOKENIZER_FILE, MERGES_FILE, SPECIAL_ROLES, SPM_FILE, VOCAB_FILE, Role, checked_ids,
    read_tokenizer_config, write_tokenizer_config,
)
from glasslm.tokenizers.bpe import BPETokenizer, gpt2_vocab, token_text
from glasslm.tokenizers.char import CharTokenizer
from glasslm.tokenizers.sentencepiece import SentencePieceTokenizer

# Names a BPE vocabulary uses for its start/end of text, in order of preference.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|im_start|>", ENDOFTEXT)
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|im_end|>", ENDOFTEXT)


def _tokenizers_lib():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("Hugging Face tokenizer files need the tokenizers package: pip install tokenizers") from None
    return tokenizers


def _role_token(value) -> str | None:
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
        try:
            return cls.from_json((root / HF_TOKENIZER_FILE).read_text(encoding="utf-8"), read_tokenizer_config(root))
        except ValueError as err:
            raise ValueError(f"{root / HF_TOKENIZER_FILE}: {err}") from None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """`encode` of each text, by the `tokenizers` library's parallel batch encoder (its own
        thread pool, sized by RAYON_NUM_THREADS; `num_threads` is accepted for a uniform call).

        >>> tok = HFTokenizer.from_json(to_hf_json(CharTokenizer.from_text("abc")))
        >>> tok.encode_batch(["cab", "a"])
        [[2, 0, 1], [0]]
        """
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_iterable(self, chunks: Iterable[str]) -> Iterator[int]:
        # A general tokenizer.json has no cut point known to be safe, so the text is encoded whole.
        yield from self.encode("".join(chunks))

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(checked_ids(ids, self.vocab_size), skip_special_tokens=False)

    def role_ids(self) -> dict[Role, int | None]:
        """{"bos": id, "eos": id, "pad": id, "unk": id} as tokenizer_config.json names them (None if not)."""
        out: dict[Role, int | None] = {}
        for role in SPECIAL_ROLES:
            text = _role_token(self.config.get(f"{role}_token"))
            out[role] = self.backend.token_to_id(text) if text is not None else None
        return out

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / HF_TOKENIZER_FILE).write_text(self.backend.to_str(), encoding="utf-8")
        write_tokenizer_config(path, self.config)


def special_token_ids(tokenizer) -> dict[Role, int | None]:
    """Which ids are bos / eos / pad / unk for any glasslm tokenizer (None where it has none).

    A char or BPE vocabulary's `<|endoftext|>` is both bos and eos, as in GPT-2 (a char tokenizer
    saved before it had one has none); `<s>`/`</s>` and Llama 3's names are recognised too.
    Hugging Face and SentencePiece tokenizers say themselves.

    Example:
        >>> special_token_ids(CharTokenizer.from_text("ab"))
        {'bos': 2, 'eos': 2, 'pad': None, 'unk': None}
        >>> special_token_ids(CharTokenizer(["a", "b"]))
        {'bos': None, 'eos': None, 'pad': None, 'unk': None}
    """
    if tokenizer is None:
        return {role: None for role in SPECIAL_ROLES}
    if hasattr(tokenizer, "role_ids"):
        return tokenizer.role_ids()
    specials = getattr(tokenizer, "special_tokens", None) or {}  # a bare encode/decode object has none
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
      character, decoded by fusing the characters back together (no spaces added); its special
      tokens (`<|endoftext|>`) as added tokens, as for BPE.
    * byte-level BPE (ours or GPT-2's): a BPE model over GPT-2's byte alphabet with the same
      merges, GPT-2's pre-tokenizer regex, and the special tokens as added tokens.
    * an `HFTokenizer`: its own JSON.
    A SentencePiece tokenizer is not converted (it is saved as its tokenizer.model).
    """
    if isinstance(tokenizer, HFTokenizer):
        return json.loads(tokenizer.backend.to_str())
    if isinstance(tokenizer, CharTokenizer):
        return _char_json(tokenizer)
    if isinstance(tokenizer, BPETokenizer):
        return _bpe_json(tokenizer)
    raise ValueError(f"cannot write a {getattr(tokenizer, 'kind', type(tokenizer).__name__)} tokenizer as tokenizer.json")


def _char_json(tokenizer: CharTokenizer) -> dict:
    # Special tokens are added tokens (split out before pre-tokenizing, as glasslm's encode does)
    # and in the vocabulary too, as GPT-2's vocab.json holds <|endoftext|>.
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    vocab = {c: i for i, c in enumerate(tokenizer.chars)} | dict(specials)
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added_token(s, i) for s, i in specials], "normalizer": None,
        # [\s\S] is any one character, newlines included: each character becomes its own piece.
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def _bpe_json(tokenizer: BPETokenizer) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added_token(s, i) for s, i in specials],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": gpt2_vocab(tokenizer), "merges": [[token_text(a), token_text(b)] for a, b in tokenizer.merges]},
    }


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


def save_hf_tokenizer(tokenizer, directory: str | os.PathLike, context_length: int | None = None,
                      chat_template: str | None = None) -> None:
    """Write `tokenizer` as files `transformers.AutoTokenizer.from_pretrained(directory)` loads; a
    `chat_template` goes to chat_template.jinja (where transformers 5 reads it first) and to
    tokenizer_config.json's `chat_template` (where earlier versions read it), so
    `apply_chat_template` works on the directory."""
    from glasslm.tokenizers.chat import CHAT_TEMPLATE_FILE

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, SentencePieceTokenizer):
        tokenizer.save(path)
        config = dict(tokenizer.config)
    else:
        (path / HF_TOKENIZER_FILE).write_text(json.dumps(to_hf_json(tokenizer), ensure_ascii=False, indent=2),
                                              encoding="utf-8")
        config = hf_tokenizer_config(tokenizer, context_length)
    if chat_template is not None:
        config["chat_template"] = chat_template
        (path / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    write_tokenizer_config(path, config)


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

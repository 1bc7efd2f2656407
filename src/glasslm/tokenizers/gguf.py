"""Tokenizers as GGUF files hold them (`tokenizer.ggml.*` keys), both ways.

A GGUF file carries its vocabulary as plain lists, and llama.cpp runs it with its own tokenizer
code. Two kinds cover the models glasslm runs:

* "gpt2": byte-level BPE. `tokens` are in GPT-2's byte alphabet, `merges` are "a b" strings in rank
  order, and `pre` names how text is cut into words first, by llama.cpp's own name for a set of
  regexes ("gpt-2", "llama-bpe", "qwen2", "smollm", ...; `PRE_TOKENIZERS`). Each regex cuts the
  pieces the previous one left, keeping both what it matched and what it did not.
* "llama": SentencePiece-style BPE (Llama 1/2, TinyLlama, Mistral v0.1, Gemma): `scores` rank the
  tokens (two pieces merge when their concatenation is a token; the highest score merges first),
  words start with "▁" (a space, with one added at the start where `add_space_prefix`), and text
  outside the vocabulary falls back to its bytes, the `<0xNN>` tokens. Spaces are kept as they are
  (llama.cpp applies none of SentencePiece's own normalization rules).

`token_type` marks each token: 1 normal, 2 unknown, 3 control (special: bos, eos, <|im_start|>),
4 user-defined (added text), 5 unused, 6 byte. `tokenizer_from_gguf` builds the same tokenizer as
a Hugging Face `tokenizer.json` (run by the tokenizers library, as `HFTokenizer`), with a
tokenizer_config.json that names its special tokens and keeps the file's chat template;
`gguf_vocabulary` goes the other way, for writing a GGUF file llama.cpp runs.

Example:
    >>> meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
    ...         "tokenizer.ggml.tokens": ["a", "b", "Ġ", "ab", "Ġab", "<|end|>"],
    ...         "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3],
    ...         "tokenizer.ggml.merges": ["a b", "Ġ ab"], "tokenizer.ggml.eos_token_id": 5}
    >>> tok = tokenizer_from_gguf(meta)
    >>> tok.encode("ab ab<|end|>"), tok.decode([3, 4]), tok.config["eos_token"]
    ([3, 4, 5], 'ab ab', '<|end|>')
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from glasslm.runtime import collector_paused
from glasslm.tokenizers.bpe import BPETokenizer, gpt2_vocab, token_text
from glasslm.tokenizers.char import CharTokenizer
from glasslm.tokenizers.hf import HFTokenizer, special_token_ids, to_hf_json
from glasslm.tokenizers.sentencepiece import SentencePieceTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"  # "▁", SentencePiece's space

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """A llama.cpp pre-tokenizer: regexes applied in turn, and whether a word found whole in the
    vocabulary skips the merges (llama.cpp's `ignore_merges`, Llama 3's tokenizer.json's too)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False


# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) and the regexes each stands for; names that
# share regexes in llama.cpp share an entry here. The first name of each is the one written on export.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": PreTokenizer((_GPT2,)),
    "llama-bpe": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "qwen2": PreTokenizer((_QWEN2,)),
    "smollm": PreTokenizer((r"\p{N}", _GPT2)),
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
}
_PRE_ALIASES = {
    **dict.fromkeys(("gpt2", "phi-2", "mpt", "olmo"), "gpt-2"),
    **dict.fromkeys(("llama3", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"), "llama-bpe"),
    **dict.fromkeys(("deepseek-r1-qwen", "stablelm2"), "qwen2"),
    **dict.fromkeys(("starcoder", "refact", "codeshell", "exaone", "minerva"), "smollm"),
}


class UnsupportedTokenizerError(ValueError):
    """A GGUF vocabulary glasslm cannot run exactly as llama.cpp does (refused, never approximated)."""


def _key(metadata: Mapping[str, Any], name: str, default: Any = None) -> Any:
    return metadata.get(f"tokenizer.ggml.{name}", default)


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The regexes of a `tokenizer.ggml.pre` name (a file without one gets llama.cpp's "default")."""
    name = _PRE_ALIASES.get(name or "default", name or "default")
    if name not in PRE_TOKENIZERS:
        known = sorted({*PRE_TOKENIZERS, *_PRE_ALIASES})
        raise UnsupportedTokenizerError(
            f"this GGUF file's pre-tokenizer {name!r} is not one glasslm runs (it cuts words with its own "
            f"regexes, so another would give other token ids); known: {', '.join(known)}")
    return PRE_TOKENIZERS[name]


def _pre_tokenizer_json(pre: PreTokenizer) -> dict[str, Any]:
    splits = [{"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
              for regex in pre.regexes]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[dict[str, Any]]:
    """Control and user-defined tokens, matched whole in any text (control ones are special)."""
    # (The ids picked out by C-level iterators: a 128k-token vocabulary holds a few hundred of them.)
    ids = itertools.compress(range(len(types)), map((CONTROL, USER_DEFINED).__contains__, types))
    return [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": types[i] == CONTROL} for i in ids]


def _vocabulary(tokens: Sequence[str]) -> dict[str, int]:
    """Token text -> id (a text listed twice: its last id, as a dict display gives)."""
    return dict(zip(tokens, range(len(tokens))))


def _bpe_json(metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]) -> dict[str, Any]:
    pre = pre_tokenizer(_key(metadata, "pre"))
    vocab = _vocabulary(tokens)
    # A merge whose result is no token never applies in llama.cpp's BPE (it falls back to the parts), and
    # Hugging Face's BPE refuses one: such a merge (a char vocabulary's placeholder) is left out.
    # (Kept as "left right" strings, which the tokenizers library splits at the first space, as here.)
    merges = [merge for merge in _key(metadata, "merges", []) if merge.replace(" ", "", 1) in vocab]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(tokens, types),
        "normalizer": None, "pre_tokenizer": _pre_tokenizer_json(pre), "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": merges},
    }


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[list[str]]:
    """BPE merges equal to SentencePiece's rule "merge the adjacent pair whose concatenation is the
    highest-scoring token": every split of a token into two tokens, ranked by the token's score.

    >>> spm_merges(["a", "b", "ab", "abb"], [0.0, 0.0, -1.0, -2.0], [1, 1, 1, 1])
    [['a', 'b'], ['ab', 'b']]
    """
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    # Both halves of a split are other tokens, so neither is longer than the second-longest token:
    # only the cuts that leave that much on each side are tried (one hostile 100,000-character token
    # would otherwise take 10**10 steps).
    longest = sorted(map(len, ids))[-2] if len(ids) > 1 else 0
    found = []
    for piece, piece_id in ids.items():
        for cut in range(max(1, len(piece) - longest), min(len(piece), longest + 1)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-scores[piece_id], piece_id, ids[left], ids[right], left, right))
    return [[left, right] for *_, left, right in sorted(found)]


def _spm_json(metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]) -> dict[str, Any]:
    scores = _key(metadata, "scores") or [0.0] * len(tokens)
    prefix = bool(_key(metadata, "add_space_prefix", True))
    unk = next((tokens[i] for i, kind in enumerate(types) if kind == UNKNOWN), None)
    decoders = [{"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    # llama.cpp puts a space before every stretch of text that starts the input or follows a special
    # or added token; the tokenizers library normalizes each such stretch apart, so Prepend does the same.
    normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE}]
    if prefix:
        normalizers.insert(0, {"type": "Prepend", "prepend": SPM_SPACE})
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(tokens, types),
        "normalizer": {"type": "Sequence", "normalizers": normalizers}, "pre_tokenizer": None,
        "post_processor": None, "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": _vocabulary(tokens), "merges": spm_merges(tokens, scores, types)},
    }


_ROLE_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}


def _tokenizer_config(metadata: Mapping[str, Any], tokens: Sequence[str]) -> dict[str, Any]:
    """tokenizer_config.json's content: the special tokens by role, bos/eos adding, the chat template."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for role, key in _ROLE_KEYS.items():
        i = _key(metadata, key)
        if isinstance(i, int) and 0 <= i < len(tokens):
            config[f"{role}_token"] = tokens[i]
    for flag in ("add_bos_token", "add_eos_token"):
        if _key(metadata, flag) is not None:
            config[flag] = bool(_key(metadata, flag))
    if isinstance(metadata.get("tokenizer.chat_template"), str):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def _check_lists(metadata: Mapping[str, Any], tokens: Any, types: Any) -> None:
    """The vocabulary's lists are what their keys say (a file is untrusted input): ValueError naming
    the key otherwise."""
    def listed(name: str, value: Any, kinds: tuple[type, ...], length: int | None = None) -> None:
        # (Exact types, bool excluded: the reader makes plain str, int and float, and one set of a
        # list's types is ~10x faster than a check per entry on a 128k-token vocabulary.)
        if not isinstance(value, list) or not set(map(type, value)) <= set(kinds):
            raise ValueError(f"tokenizer.ggml.{name} is not a list of {' or '.join(k.__name__ for k in kinds)}s")
        if length is not None and len(value) != length:
            raise ValueError(f"tokenizer.ggml.{name} has {len(value):,} entries for {length:,} tokens")

    listed("tokens", tokens, (str,))
    listed("token_type", types, (int,), len(tokens))
    if _key(metadata, "merges") is not None:
        listed("merges", _key(metadata, "merges"), (str,))
    if _key(metadata, "scores") is not None:
        listed("scores", _key(metadata, "scores"), (int, float), len(tokens))
    for name in ("model", "pre"):
        if _key(metadata, name) is not None and not isinstance(_key(metadata, name), str):
            raise ValueError(f"tokenizer.ggml.{name} is {_key(metadata, name)!r}, not a name")


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer a GGUF file's `tokenizer.ggml.*` keys describe, as an `HFTokenizer`.

    Raises `UnsupportedTokenizerError` for a vocabulary kind or pre-tokenizer it would not run as
    llama.cpp does, and ValueError for a file without a vocabulary.
    """
    with collector_paused():  # (its lists of merges and their pairs are garbage at once, and hold no cycles)
        return _tokenizer_from_gguf(metadata)


def _tokenizer_from_gguf(metadata: Mapping[str, Any]) -> HFTokenizer:
    tokens = _key(metadata, "tokens")
    if not tokens:
        raise ValueError("this GGUF file holds no vocabulary (tokenizer.ggml.tokens)")
    types = _key(metadata, "token_type") or ([NORMAL] * len(tokens) if isinstance(tokens, list) else None)
    _check_lists(metadata, tokens, types)
    kind = _key(metadata, "model")
    if kind == "gpt2":
        data = _bpe_json(metadata, tokens, types)
    elif kind == "llama":
        data = _spm_json(metadata, tokens, types)
    else:
        raise UnsupportedTokenizerError(f"this GGUF file's tokenizer model {kind!r} is not supported "
                                        "(glasslm reads 'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies)")
    return _with_bpe_model(data, _tokenizer_config(metadata, tokens))


def _with_bpe_model(data: dict[str, Any], config: Mapping[str, Any]) -> HFTokenizer:
    """`HFTokenizer.from_json(data, config)`, the BPE model's vocabulary and merges handed to the
    tokenizers library as a dict and a list rather than written into the JSON text it parses: the same
    tokenizer (`backend.to_str()` is the same text, tests/tokenizers/test_gguf_tokenizer.py), in a
    third of the time (a 128k-token vocabulary: ~0.08 s, not ~0.25 s of json.dumps and from_str, at
    every load of a Llama 3 file)."""
    from tokenizers import AddedToken
    from tokenizers.models import BPE

    model = data["model"]
    options = {k: v for k, v in model.items() if k not in ("type", "vocab", "merges") and v is not None}
    # (The added tokens go in after the model: an added token takes the model's id for its text, and
    # a model still empty would give it another.)
    empty = {**data, "added_tokens": [], "model": {**model, "vocab": {}, "merges": []}}
    tokenizer = HFTokenizer.from_json(empty, config)
    merges = model["merges"]  # "left right" strings (gpt2) or [left, right] lists (llama), all alike
    strings = bool(merges) and isinstance(merges[0], str)
    pairs = [tuple(m.split(" ", 1)) for m in merges] if strings else list(map(tuple, merges))
    try:
        tokenizer.backend.model = BPE(vocab=model["vocab"], merges=pairs, **options)
    except Exception as err:  # the Rust side raises plain Exceptions
        raise ValueError(f"not a BPE vocabulary the tokenizers library can read: {err}") from None
    tokenizer.backend.add_tokens([AddedToken(t["content"], single_word=t["single_word"], lstrip=t["lstrip"],
                                             rstrip=t["rstrip"], normalized=t["normalized"], special=t["special"])
                                  for t in data["added_tokens"]])
    return tokenizer


@dataclasses.dataclass
class GGUFVocabulary:
    """What a GGUF file says of a tokenizer: `model` ("gpt2" or "llama"), `pre` (gpt2 only), the
    tokens, their types, merges (gpt2) or scores (llama), special ids by role, and flags."""

    model: str
    tokens: list[str]
    token_types: list[int]
    pre: str | None = None
    merges: list[str] | None = None
    scores: list[float] | None = None
    special_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    add_bos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None


def gguf_vocabulary(tokenizer: Any, chat_template: str | None = None, rows: int | None = None) -> GGUFVocabulary:
    """`tokenizer` as GGUF vocabulary keys: glasslm's char and BPE tokenizers, a Hugging Face
    byte-level BPE `tokenizer.json` whose word-cutting one of llama.cpp's pre-tokenizers reproduces,
    or a SentencePiece model. Anything else is refused, naming what does not fit.

    `rows` is the model's embedding rows: llama.cpp wants a token per row, so ids past the
    tokenizer's get unused `[PADn]` tokens (as llama.cpp's converter writes them).
    """
    if isinstance(tokenizer, SentencePieceTokenizer):
        vocab = _spm_vocabulary(tokenizer)
    elif isinstance(tokenizer, (CharTokenizer, BPETokenizer, HFTokenizer)):
        vocab = _bpe_vocabulary(tokenizer)
    else:
        raise UnsupportedTokenizerError(f"a {type(tokenizer).__name__} cannot be written as a GGUF vocabulary")
    if rows is not None and rows < len(vocab.tokens):
        raise UnsupportedTokenizerError(f"the tokenizer has {len(vocab.tokens)} tokens, more than the model's {rows} rows")
    for i in range(len(vocab.tokens), rows or 0):
        vocab.tokens.append(f"[PAD{i}]")
        vocab.token_types.append(UNUSED)
        if vocab.scores is not None:
            vocab.scores.append(-1e9)
    roles = special_token_ids(tokenizer)
    vocab.special_ids = {role: i for role, i in roles.items() if i is not None}
    config = getattr(tokenizer, "config", None) or {}
    vocab.add_bos = bool(config.get("add_bos_token", False))
    vocab.chat_template = chat_template if chat_template is not None else config.get("chat_template")
    return vocab


def _bpe_vocabulary(tokenizer: Any) -> GGUFVocabulary:
    if isinstance(tokenizer, CharTokenizer):
        return _char_vocabulary(tokenizer)
    if isinstance(tokenizer, BPETokenizer):
        vocab = gpt2_vocab(tokenizer)
        merges = [f"{token_text(a)} {token_text(b)}" for a, b in tokenizer.merges]
        pre = "gpt-2"
    else:
        data = to_hf_json(tokenizer)
        model = data.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback") or not _is_byte_level(data):
            raise UnsupportedTokenizerError(
                "only byte-level BPE tokenizer.json files (GPT-2, SmolLM, Qwen, Llama 3 style) are written as GGUF "
                f"vocabularies; this one is a {model.get('type')} model")
        vocab = {**model["vocab"], **{t["content"]: t["id"] for t in data.get("added_tokens") or []}}
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        pre = matching_pre_tokenizer(tokenizer)
    tokens = _tokens_by_id(vocab, tokenizer.vocab_size)
    specials = set(getattr(tokenizer, "special_tokens", {}) or {})
    types = [CONTROL if t in specials else NORMAL for t in tokens]
    return GGUFVocabulary("gpt2", tokens, types, pre=pre, merges=merges)


def _tokens_by_id(vocab: Mapping[str, int], size: int) -> list[str]:
    tokens: list[str | None] = [None] * size
    for text, i in vocab.items():
        if 0 <= i < size:
            tokens[i] = text
    missing = [i for i, t in enumerate(tokens) if t is None]
    if missing:
        raise UnsupportedTokenizerError(f"the vocabulary has no token for ids {missing[:5]}; GGUF lists every id")
    return tokens  # type: ignore[return-value]


def _char_vocabulary(tokenizer: CharTokenizer) -> GGUFVocabulary:
    """A char vocabulary as byte-level BPE: every one-byte character is its own token, which is what
    llama.cpp's BPE gives a text of those characters when no merge applies.

    llama.cpp refuses a BPE vocabulary without a merges list ("cannot find tokenizer merges"), and GGUF
    (the gguf package) writes no empty list, so the list holds one merge that never applies: a
    character that is not whitespace followed by one that is. GPT-2's word-cutting puts whitespace
    inside a word only at its start, so no word holds that pair (`_placeholder_merge`)."""
    from glasslm.tokenizers.bpe import bytes_to_unicode

    wide = [c for c in tokenizer.chars if len(c.encode("utf-8")) != 1]
    if wide:
        raise UnsupportedTokenizerError(f"char vocabularies export to GGUF when every character is one byte; "
                                        f"{wide[:3]} are not")
    alphabet = bytes_to_unicode()
    vocab = {alphabet[c.encode("utf-8")[0]]: i for i, c in enumerate(tokenizer.chars)} | dict(tokenizer.special_tokens)
    tokens = _tokens_by_id(vocab, tokenizer.vocab_size)
    types = [CONTROL if t in tokenizer.special_tokens else NORMAL for t in tokens]
    merge = _placeholder_merge(tokenizer.chars)
    return GGUFVocabulary("gpt2", tokens, types, pre="gpt-2",
                          merges=[" ".join(alphabet[ord(c)] for c in merge)])


def _placeholder_merge(chars: Sequence[str]) -> tuple[str, str]:
    """Two characters of the vocabulary that no GPT-2 word holds side by side: (not whitespace, whitespace).

    >>> _placeholder_merge(["\\n", " ", "A", "a"])
    ('A', '\\n')
    """
    solid = next((c for c in chars if not c.isspace()), None)
    space = next((c for c in chars if c.isspace()), None)
    if solid is None or space is None:
        raise UnsupportedTokenizerError("a char vocabulary exports to GGUF when it holds a whitespace character and "
                                        "another one (llama.cpp needs a merge that never applies between them)")
    return solid, space


def _is_byte_level(data: Mapping[str, Any]) -> bool:
    steps = data.get("pre_tokenizer") or {}
    steps = steps.get("pretokenizers", [steps]) if steps.get("type") == "Sequence" else [steps]
    return any(step.get("type") == "ByteLevel" for step in steps) and not data.get("normalizer")


# Texts on which two word-cutting rules that differ anywhere in practice give different pieces.
_PROBES = ("Hello world! It's 2024: you'll see 12345 apples, DON'T they've  spaces\n\n  end.",
           "naïve café — 東京 123abc\tx\r\ny ...!!! $100 <tag> a+b=c ~x |y| ^z `q`",
           "line one\n  indented  \n\ttab 7 77 777 7777 'quote' \"double\" snake_case CamelCase")


def matching_pre_tokenizer(tokenizer: HFTokenizer) -> str:
    """The llama.cpp pre-tokenizer name that cuts text into the same words as `tokenizer`'s own
    pre-tokenizer, found by comparing the words each makes of probe texts."""
    ours = tokenizer.backend.pre_tokenizer
    if ours is None:
        raise UnsupportedTokenizerError("the tokenizer has no pre-tokenizer, so no llama.cpp pre-tokenizer matches it")
    words = [[w for w, _ in ours.pre_tokenize_str(text)] for text in _PROBES]
    for name, pre in PRE_TOKENIZERS.items():
        candidate = _build_pre_tokenizer(pre)
        if [[w for w, _ in candidate.pre_tokenize_str(text)] for text in _PROBES] == words:
            return name
    raise UnsupportedTokenizerError("this tokenizer cuts text into words in a way none of llama.cpp's pre-tokenizers "
                                    f"known here does ({', '.join(PRE_TOKENIZERS)}); it cannot be written as GGUF")


def _build_pre_tokenizer(pre: PreTokenizer) -> Any:
    from tokenizers import Tokenizer

    data = {"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []},
            "pre_tokenizer": _pre_tokenizer_json(pre)}
    return Tokenizer.from_str(json.dumps(data)).pre_tokenizer


def _spm_vocabulary(tokenizer: SentencePieceTokenizer) -> GGUFVocabulary:
    sp = tokenizer.sp
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(CONTROL if sp.is_control(i) else UNKNOWN if sp.is_unknown(i) else BYTE if sp.is_byte(i)
                     else UNUSED if sp.is_unused(i) else NORMAL)
    # SentencePiece adds a space before the text where its normalizer says so (Llama: yes, Gemma: no).
    first = sp.encode("a", out_type=str)
    prefix = bool(first) and first[0].startswith(SPM_SPACE)
    return GGUFVocabulary("llama", tokens, types, scores=scores, add_space_prefix=prefix)

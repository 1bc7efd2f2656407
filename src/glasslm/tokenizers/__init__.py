"""Tokenizers: text <-> token ids, all behind one small interface (`Tokenizer`).

Every tokenizer has `vocab_size`, `special_tokens` (str -> id), `encode(text) -> list[int]`,
`decode(ids) -> str`, `encode_iterable(chunks) -> Iterator[int]` and `save(directory)`;
`load_tokenizer(directory)` reads back whatever `save` wrote, and `get_tokenizer(spec)` makes one
from "char", "gpt2" or a saved directory.

Kinds, one module each:
    * `CharTokenizer` (`char`): one id per character seen in the training text, then `<|endoftext|>`.
    * `BPETokenizer` (`bpe`): byte-level BPE, trained here (`train_tokenizer`, `trainer`) or
      GPT-2's released vocabulary (`gpt2_tokenizer`, `gpt2`), optionally encoding through tiktoken.
    * `HFTokenizer` (`hf`): any Hugging Face `tokenizer.json` run by the `tokenizers` library, with
      its special and added tokens; `to_hf_json` / `save_hf_tokenizer` write any of the kinds as
      files `transformers.AutoTokenizer` loads (used by export).
    * `SentencePieceTokenizer` (`sentencepiece`): a SentencePiece `tokenizer.model` (needs the
      sentencepiece package).

`base` holds the interface, `ENDOFTEXT` and the file names; `pretokens` GPT-2's pre-tokenizer,
shared by the BPE encoder and trainer; `loading` reads and makes tokenizers.

Example:
    >>> tok = CharTokenizer.from_text("hello world")
    >>> tok.decode(tok.encode("hello"))
    'hello'
    >>> bpe = train_tokenizer_from_text("the cat sat on the mat " * 20, vocab_size=270)
    >>> bpe.decode(bpe.encode("the rat" + ENDOFTEXT))
    'the rat<|endoftext|>'
    >>> isinstance(bpe, Tokenizer)
    True
"""

from glasslm.tokenizers.base import (
    BPE_DESCRIPTOR_FILE,
    CHAR_DESCRIPTOR_FILE,
    ENDOFTEXT,
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_FILE,
    MERGES_FILE,
    SPECIAL_ROLES,
    SPM_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    VOCAB_FILE,
    Tokenizer,
)
from glasslm.tokenizers.bpe import BACKENDS, BPETokenizer, bytes_to_unicode
from glasslm.tokenizers.char import CharTokenizer
from glasslm.tokenizers.eos import GENERATION_CONFIG_FILE, bos_token_id, eos_token_ids, read_generation_config
from glasslm.tokenizers.gpt2 import GPT2_SHA256, find_gpt2_files, gpt2_tokenizer
from glasslm.tokenizers.hf import (
    HFTokenizer,
    hf_tokenizer_config,
    read_hf_tokenizer,
    same_vocabulary,
    save_hf_tokenizer,
    special_token_ids,
    to_hf_json,
)
from glasslm.tokenizers.loading import get_tokenizer, has_tokenizer, load_tokenizer
from glasslm.tokenizers.sentencepiece import SentencePieceTokenizer
from glasslm.tokenizers.trainer import train_tokenizer, train_tokenizer_from_text

__all__ = [
    "BACKENDS", "BPE_DESCRIPTOR_FILE", "CHAR_DESCRIPTOR_FILE", "ENDOFTEXT", "GPT2_SHA256", "HF_TOKENIZER_CONFIG",
    "HF_TOKENIZER_FILE", "GENERATION_CONFIG_FILE", "MERGES_FILE", "SPECIAL_ROLES", "SPM_FILE", "TOKENIZER_FILE",
    "TOKENIZER_FILES", "VOCAB_FILE", "BPETokenizer", "CharTokenizer", "HFTokenizer", "SentencePieceTokenizer",
    "Tokenizer", "bos_token_id", "bytes_to_unicode", "eos_token_ids", "find_gpt2_files", "get_tokenizer",
    "gpt2_tokenizer", "has_tokenizer", "hf_tokenizer_config", "load_tokenizer", "read_generation_config",
    "read_hf_tokenizer", "same_vocabulary", "save_hf_tokenizer", "special_token_ids", "to_hf_json",
    "train_tokenizer", "train_tokenizer_from_text",
]

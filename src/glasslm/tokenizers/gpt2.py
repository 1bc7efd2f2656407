"""GPT-2's released tokenizer (50257 ids, `<|endoftext|>` = 50256) from local files: glasslm never
downloads it. The files live in the data directory (`glasslm.locations.data_dir`) or its `gpt2/`
subdirectory.

Example:
    >>> import tempfile
    >>> find_gpt2_files(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    FileNotFoundError: GPT-2 tokenizer files not found under ...
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from glasslm.locations import DATA_DIR_RULE
from glasslm.locations import data_dir as resolve_data_dir
from glasslm.tokenizers.base import ENDOFTEXT, MERGES_FILE, VOCAB_FILE
from glasslm.tokenizers.bpe import GPT2_NAME, Backend, BPETokenizer
from glasslm.tokenizers.hf import to_hf_json

# SHA-256 of GPT-2's released files (encoder.json; vocab.bpe with and without its header line).
GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "vocab.bpe (no header)": "ac33235097fe06d4a8fff0feac994644809e6eb6ab70669e1e9fd40ae032428e",
}


# SHA-256 of GPT-2's 50,257 tokens and 50,000 merges as `gpt2_fingerprint` lists them.
GPT2_FINGERPRINT = "1f4d8dc1254bdbde4d8fdb9d0ac91df2173b912d6d3a114c7b049634a35b7ba3"
GPT2_TOKENS = 50257


GPT2_SUBDIR = "gpt2"  # the data directory's subdirectory searched first
# (vocab, merges) file names, in order of preference: ours, OpenAI's release, Hugging Face's.
_GPT2_NAMES = [("gpt2_vocab.json", "gpt2_merges.txt"), ("encoder.json", "vocab.bpe"), (VOCAB_FILE, MERGES_FILE)]


def find_gpt2_files(data_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Locate GPT-2's vocab and merges files in the data directory (`data_dir`, else
    $GLASSLM_DATA_DIR, else ~/.cache/glasslm) or its `gpt2/` subdirectory, named
    gpt2_vocab.json + gpt2_merges.txt, encoder.json + vocab.bpe, or vocab.json + merges.txt.
    Raises FileNotFoundError saying what to put where."""
    root = resolve_data_dir(data_dir)
    for folder in (root / GPT2_SUBDIR, root):
        for vocab_name, merges_name in _GPT2_NAMES:
            if (folder / vocab_name).is_file() and (folder / merges_name).is_file():
                return folder / vocab_name, folder / merges_name
    (vocab_name, merges_name), *others = _GPT2_NAMES
    raise FileNotFoundError(
        f"GPT-2 tokenizer files not found under {root}: expected {root / GPT2_SUBDIR / vocab_name} and "
        f"{root / GPT2_SUBDIR / merges_name} (GPT-2's encoder.json and vocab.bpe; the names "
        f"{' or '.join('/'.join(pair) for pair in others)} also work, in {GPT2_SUBDIR}/ or directly in the "
        f"directory; data directory: {DATA_DIR_RULE}); `glasslm fetch gpt2` downloads them there "
        "(`glasslm fetch gpt2 --from DIR` copies them from a local folder)"
    )


def gpt2_tokenizer(data_dir: str | os.PathLike | None = None, backend: Backend = "auto") -> BPETokenizer:
    """GPT-2's tokenizer (50257 ids, `<|endoftext|>` = 50256) from local files, no download.

    `backend="auto"` encodes with tiktoken when it is installed (same ids, ~3x faster), else with
    glasslm's own encoder; "glasslm" or "tiktoken" force one.

    Example (needs the files; see `find_gpt2_files`):
        >>> tok = gpt2_tokenizer(backend="glasslm")  # doctest: +SKIP
        >>> tok.encode("Hello world<|endoftext|>")  # doctest: +SKIP
        [15496, 995, 50256]
    """
    vocab_file, merges_file = find_gpt2_files(data_dir)
    return BPETokenizer.from_gpt2_files(vocab_file, merges_file, (ENDOFTEXT,), name=GPT2_NAME, backend=backend)


def gpt2_fingerprint(tokenizer: Any) -> str | None:
    """SHA-256 of a byte-level BPE tokenizer's first 50,257 tokens and its merges (None for other kinds):
    equal to `GPT2_FINGERPRINT` when its ids are GPT-2's, whatever file or kind it was read from,
    and whatever special tokens it adds after them."""
    try:
        model = to_hf_json(tokenizer)["model"]
    except ValueError:  # a SentencePiece model: no tokenizer.json form, and no GPT-2 either
        return None
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    tokens = sorted((i, t) for t, i in model["vocab"].items() if i < GPT2_TOKENS)
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model.get("merges") or []]
    listing = json.dumps([tokens, merges], ensure_ascii=False)
    return hashlib.sha256(listing.encode("utf-8")).hexdigest()


def has_gpt2_ids(tokenizer: Any) -> bool:
    """Whether `tokenizer` gives every text GPT-2's ids (as tiktoken's "gpt2" encoding does).

    Example (needs the files; see `find_gpt2_files`):
        >>> has_gpt2_ids(gpt2_tokenizer())  # doctest: +SKIP
        True
    """
    return gpt2_fingerprint(tokenizer) == GPT2_FINGERPRINT

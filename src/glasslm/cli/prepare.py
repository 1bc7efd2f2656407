"""`glasslm prepare INPUTS --out DIR`: tokenize text into token files for training.

One text file (or several) gives the single-file layout, train.bin / val.bin; JSONL, parquet,
Hugging Face datasets, globs, directories, or `--shard-tokens N` give the sharded layout
(glasslm.data.shard_prepare: tokenized in parallel into shards, resumable). `load_prepared` and
`glasslm train --data DIR` read both."""

from __future__ import annotations

from dataclasses import dataclass, field

from glasslm.cli.command import Command
from glasslm.cli.common import OutputOption
from glasslm.data.splits import VAL_FRACTION


@dataclass
class PrepareConfig:
    """what to tokenize"""

    # text files, JSONL or parquet files, globs ("data/*.parquet") or directories of them, saved Hugging Face
    # datasets, Hugging Face dataset names (owner/name), or known dataset names (tinyshakespeare)
    inputs: list[str] = field(metadata={"positional": True})
    tokenizer: str = "char"  # char, gpt2, a saved tokenizer directory, or a checkpoint or run directory (its tokenizer)
    # validation data: the last fraction of each text file (from a line start), and every 1/fraction-th record
    val_fraction: float = VAL_FRACTION
    field: str = "text"  # the JSONL field holding each document's text
    column: str = "text"  # the parquet or dataset column holding each document's text
    split: str = "train"  # the Hugging Face dataset split to read
    streaming: bool = False  # stream a Hugging Face dataset instead of downloading it whole first
    # ids per shard file; 0: train.bin / val.bin for text files, 100,000,000 for JSONL, parquet and datasets
    shard_tokens: int = 0
    workers: int = 0  # tokenizing threads or processes for the sharded layout; 0: one per CPU core
    data_dir: str | None = None  # where datasets are kept; none: $GLASSLM_DATA_DIR, else ~/.cache/glasslm
    quiet: bool = False  # no progress output (progress goes to stderr)


def prepare(config: PrepareConfig, output: OutputOption) -> int:
    from glasslm.data.documents import is_single_text_input

    if config.shard_tokens or not all(map(is_single_text_input, config.inputs)):
        return _prepare_shards(config, output)
    from glasslm.data import char_vocabulary, prepare as prepare_files, resolve_text
    from glasslm.locations import check_output_dir
    from glasslm.tokenizers import ENDOFTEXT, CharTokenizer, get_tokenizer

    paths = [resolve_text(source, config.data_dir) for source in config.inputs]
    check_output_dir(output.out, output.overwrite, inputs=paths, what="dataset")  # before the slow part
    if config.tokenizer == "char":
        tokenizer = CharTokenizer(char_vocabulary(paths), special_tokens=[ENDOFTEXT])  # as CharTokenizer.from_text
    else:
        tokenizer = get_tokenizer(_tokenizer_source(config.tokenizer), data_dir=config.data_dir)
    meta = prepare_files(paths, tokenizer, output.out, config.val_fraction, progress=not config.quiet,
                         overwrite=output.overwrite)
    print(f"{output.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
          f"({meta['dtype']}, vocab {meta['vocab_size']:,})")
    return 0


def _prepare_shards(config: PrepareConfig, output: OutputOption) -> int:
    from glasslm.data.documents import corpus_characters, expand_sources
    from glasslm.data.shard_prepare import DEFAULT_SHARD_TOKENS, ReadOptions, prepare_shards
    from glasslm.tokenizers import ENDOFTEXT, CharTokenizer, get_tokenizer

    read = ReadOptions(config.field, config.column, config.split, config.streaming)
    if config.tokenizer == "char":
        chars = corpus_characters(expand_sources(config.inputs, config.data_dir), field=read.field,
                                  column=read.column, split=read.split, streaming=read.streaming)
        tokenizer = CharTokenizer(chars, special_tokens=[ENDOFTEXT])
    else:
        tokenizer = get_tokenizer(_tokenizer_source(config.tokenizer), data_dir=config.data_dir)
    meta = prepare_shards(config.inputs, tokenizer, output.out, config.val_fraction,
                          config.shard_tokens or DEFAULT_SHARD_TOKENS, config.workers or None, read,
                          progress=not config.quiet, overwrite=output.overwrite, data_dir=config.data_dir)
    print(f"{output.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens in "
          f"{meta['shards']['train']} + {meta['shards']['val']} shards ({meta['dtype']}, vocab {meta['vocab_size']:,})")
    return 0


def _tokenizer_source(spec: str) -> str:
    """A run directory names its checkpoint's tokenizer (what `glasslm eval` asks a dataset to be prepared with)."""
    from pathlib import Path

    from glasslm.io.checkpoint import resolve_checkpoint

    if not Path(spec).is_dir():
        return spec
    try:
        return str(resolve_checkpoint(spec))
    except (FileNotFoundError, ValueError):  # a tokenizer directory, not a checkpoint
        return spec


COMMAND = Command("prepare", prepare, "tokenize text, JSONL, parquet or datasets into token files for training",
                  examples=(
                      'glasslm prepare my.txt --tokenizer gpt2 --out data/mine',
                      'glasslm prepare "corpus/*.parquet" --tokenizer gpt2 --out data/corpus',
                      'glasslm train --preset shakespeare-char-cpu --data data/mine --out runs/mine',
                  ))

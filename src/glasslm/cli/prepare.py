"""`glasslm prepare FILES --out DIR`: tokenize text into train.bin / val.bin for training."""

from __future__ import annotations

from dataclasses import dataclass, field

from glasslm.cli.command import Command
from glasslm.cli.common import OutputOption
from glasslm.data.splits import VAL_FRACTION


@dataclass
class PrepareConfig:
    """what to tokenize"""

    inputs: list[str] = field(metadata={"positional": True})  # UTF-8 text files or dataset names
    tokenizer: str = "char"  # char, gpt2, a saved tokenizer directory, or a checkpoint or run directory (its tokenizer)
    val_fraction: float = VAL_FRACTION  # the last fraction of each file (from a line start) becomes validation data
    data_dir: str | None = None  # where datasets are kept; none: $GLASSLM_DATA_DIR, else ~/.cache/glasslm
    quiet: bool = False  # no progress output (progress goes to stderr)


def prepare(config: PrepareConfig, output: OutputOption) -> int:
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


COMMAND = Command("prepare", prepare, "tokenize text files into train.bin / val.bin for training",
                  examples=(
                      'glasslm prepare my.txt --tokenizer gpt2 --out data/mine',
                      'glasslm train --preset shakespeare-char-cpu --data data/mine --out runs/mine',
                  ))

"""`glasslm train-tokenizer FILES --vocab-size N --out DIR`: a byte-level BPE vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field

from glasslm.cli.command import Command
from glasslm.tokenizers import ENDOFTEXT
from glasslm.cli.common import OutputOption


@dataclass
class TokenizerTrainingConfig:
    """the vocabulary"""

    inputs: list[str] = field(metadata={"positional": True})  # UTF-8 text files or dataset names
    vocab_size: int = field(metadata={"minimum": 1})  # tokens in the vocabulary: 256 bytes + merges + special tokens
    # strings kept whole, never merged or split
    special_tokens: list[str] = field(default_factory=lambda: [ENDOFTEXT], metadata={"nargs": "*"})
    workers: int | None = None  # pre-tokenizing processes; none: all cores
    data_dir: str | None = None  # where datasets are kept; none: $GLASSLM_DATA_DIR, else ~/.cache/glasslm


def train_tokenizer(config: TokenizerTrainingConfig, output: OutputOption) -> int:
    import time

    from glasslm.data import resolve_text
    from glasslm.tokenizers import train_tokenizer as train_bpe

    paths = [resolve_text(source, config.data_dir) for source in config.inputs]
    start = time.perf_counter()  # train_tokenizer refuses an --out that would lose data, before any work
    tokenizer = train_bpe(paths, config.vocab_size, config.special_tokens, output.out, config.workers,
                          overwrite=output.overwrite)
    print(f"trained a {tokenizer.vocab_size:,}-token byte-level BPE in {time.perf_counter() - start:.2f} s "
          f"-> {output.out} (vocab.json, merges.txt)")
    return 0


COMMAND = Command("train-tokenizer", train_tokenizer, "train a byte-level BPE vocabulary on text files",
                  examples=(
                      'glasslm train-tokenizer my.txt --vocab-size 1024 --out tok/mine',
                      'glasslm prepare my.txt --tokenizer tok/mine --out data/mine',
                  ))

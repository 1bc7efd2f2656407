"""Data: datasets on disk, the train/validation split, prepared token files and training batches.

Modules, one job each:
    * `datasets`: known datasets (`DATASETS`), fetched once and verified (`fetch_dataset`), and
      `resolve_text` (a dataset name or a text file -> its path).
    * `splits`: the one split rule (`split_offset`; `VAL_FRACTION` of each file, from a line
      start, is validation text) and `train_val_split` for tokens that come from no file.
    * `prepared`: `prepare` tokenizes text files once into `train.bin` / `val.bin` + `meta.json`;
      `load_prepared` memory-maps them back.
    * `documents`: a corpus's inputs (text, JSONL, parquet, Hugging Face datasets, globs and
      directories of them) read as documents, each record's split decided by its number.
    * `shard_prepare`: `prepare_shards` tokenizes documents in parallel into fixed-size shards,
      resumable; `sharded` reads each split's shards back as one `ShardedTokens` stream.
    * `batches`: `get_batch` (random contiguous windows) and `load_training_data` (a prepared
      directory, or a text file tokenized in memory).

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.txt").write_text("to be or not to be\\n" * 50)
    >>> data = load_training_data(str(d / "a.txt"))
    >>> x, y = get_batch(data.train, batch_size=2, context_length=8)
    >>> x.shape, data.tokenizer.decode(y[0].tolist()) in ("to be or not to be\\n" * 3)
    (torch.Size([2, 8]), True)
"""

from glasslm.data.batches import get_batch, load_training_data, read_windows, window_starts
from glasslm.data.datasets import (DATASETS, FILE_SETS, DatasetInfo, fetch_dataset, held_by, known_names,
                                   resolve_text, sha256_of)
from glasslm.data.prepared import (
    META_FILE,
    TOKEN_DTYPES,
    TokenData,
    char_vocabulary,
    check_prepared,
    is_prepared,
    load_prepared,
    load_token_file,
    prepare,
    token_dtype,
    token_file,
)
from glasslm.data.shard_prepare import prepare_shards
from glasslm.data.sharded import ShardedTokens
from glasslm.data.splits import SPLITS, VAL_FRACTION, read_split, split_offset, split_texts, train_val_split

__all__ = [
    "DATASETS", "FILE_SETS", "META_FILE", "SPLITS", "TOKEN_DTYPES", "VAL_FRACTION", "DatasetInfo", "ShardedTokens",
    "TokenData", "prepare_shards",
    "char_vocabulary", "check_prepared", "fetch_dataset", "get_batch", "held_by", "is_prepared", "known_names",
    "load_prepared", "load_token_file", "load_training_data", "prepare", "read_split", "read_windows", "resolve_text",
    "sha256_of", "split_offset", "split_texts", "token_dtype", "token_file", "train_val_split", "window_starts",
]

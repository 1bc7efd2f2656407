"""What a training run trains on and where it writes (`RunConfig`), and the `--config` file that
describes a whole run: RunConfig's keys at the top, [model] and [train] tables below."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from glasslm.cli.options import read_settings_file
from glasslm.core.config import ModelConfig
from glasslm.core.fields import checked, did_you_mean
from glasslm.training.config import TrainConfig
from glasslm.data.splits import VAL_FRACTION


@dataclass
class RunConfig:
    """What a training run trains on and where it writes: the top level of a `--config` file."""

    preset: str = "shakespeare-char-cpu"  # the model (glasslm info --preset NAME shows it); not with --resume
    recipe: str | None = None  # training recipe: a preset's name or 'default' (TrainConfig's); none: the preset's own
    data: str = "tinyshakespeare"  # dataset name, UTF-8 text file, or a directory made by `glasslm prepare`
    tokenizer: str = "char"  # for text files: char, gpt2, or a saved tokenizer directory
    data_dir: str | None = None  # where datasets are kept; none: $GLASSLM_DATA_DIR, else ~/.cache/glasslm
    out: str | None = None  # run directory for checkpoints and metrics.jsonl; none: runs/PRESET
    val_fraction: float = VAL_FRACTION  # the last fraction of the text (from a line start) held out for validation
    sample_tokens: int = 300  # print a sample of this many tokens when training ends; 0: none


# The tables of a --config file, beside RunConfig's keys at its top level.
CONFIG_TABLES: dict[str, type] = {"model": ModelConfig, "train": TrainConfig}


def load_config_file(path: str) -> dict[str, Any]:
    """A run description from TOML (or YAML, if PyYAML is installed), every key checked.

    Top-level keys are RunConfig's (preset, data, out, ...); the tables [model] and [train]
    override fields of ModelConfig and TrainConfig:

        preset = "shakespeare-char-cpu"
        data = "tinyshakespeare"
        [model]
        n_layers = 2
        [train]
        max_steps = 500
        dtype = "bfloat16"

    Returns RunConfig's settings with the tables' settings under "model" and "train".
    """
    data = read_settings_file(path)
    top = {k: v for k, v in data.items() if k not in CONFIG_TABLES}
    names = [f.name for f in dataclasses.fields(RunConfig)] + list(CONFIG_TABLES)
    for key in top:
        if key not in names:
            raise ValueError(f"{path}: unknown setting {key!r}{did_you_mean(str(key), names)}")
    result = checked(RunConfig, top, str(path))
    for table, cls in CONFIG_TABLES.items():
        result[table] = checked(cls, data.get(table, {}), f"{path} [{table}]")
    return result

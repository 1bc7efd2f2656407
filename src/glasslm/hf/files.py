"""The files of a Hugging Face model directory: their names (HF's, kept here once) and its config.

glasslm's own checkpoint files are named in `glasslm.io.checkpoint`; some names coincide
(`config.json`, `model.safetensors`), and `is_hf_directory` tells the two kinds apart.

Example:
    >>> import json, tempfile
    >>> from pathlib import Path
    >>> directory = Path(tempfile.mkdtemp())
    >>> _ = (directory / HF_CONFIG_FILE).write_text(json.dumps({"model_type": "gpt2"}))
    >>> is_hf_directory(directory), read_hf_config(directory)["model_type"]
    (True, 'gpt2')
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from glasslm.io.checkpoint import read_json

HF_CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CARD_FILE = "README.md"
GLASSLM_KEY = "glasslm"  # config.json entry recording what HF's format cannot (a bias-free GPT-2)


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of an HF model directory, as a dict (an error if there is none)."""
    path = Path(directory) / HF_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a Hugging Face model directory?")
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a model config")
    return data


def is_hf_directory(directory: str | os.PathLike) -> bool:
    """True if `directory/config.json` is an HF config (it names a model_type), not a glasslm one."""
    path = Path(directory) / HF_CONFIG_FILE
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return isinstance(data, dict) and "model_type" in data

"""Checkpoints as plain files: safetensors weights, JSON config, the tokenizer's own files.

Nothing here unpickles: a checkpoint from anywhere can be opened safely. Writing goes to a
temporary directory that is renamed into place, so a killed process never leaves half a checkpoint.

Example:
    >>> import tempfile
    >>> from glasslm.config import get_preset
    >>> from glasslm.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=3))
    >>> path = save_checkpoint(tempfile.mkdtemp() + "/ckpt", model, CharTokenizer.from_text("abc"))
    >>> load_checkpoint(path)[0].num_parameters() == model.num_parameters()
    True
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .model import TransformerLM
from .tokenizers import load_tokenizer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
META_FILE = "meta.json"


def save_checkpoint(
    directory: str | os.PathLike, model: TransformerLM, tokenizer: Any | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write model weights, config, tokenizer and a small JSON of metadata to `directory`, atomically."""
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        weights = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
        save_file(weights, staging / WEIGHTS_FILE, metadata={"format": "pt", "library": "glasslm"})
        (staging / CONFIG_FILE).write_text(model.config.to_json())
        if tokenizer is not None:
            tokenizer.save(staging)
        (staging / META_FILE).write_text(json.dumps(meta or {}, indent=2))
        _swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _swap_into_place(staging: Path, target: Path) -> None:
    """Replace `target` by `staging`; at every instant one complete copy exists on disk."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    directory: str | os.PathLike, device: torch.device | str = "cpu"
) -> tuple[TransformerLM, Any | None, dict[str, Any]]:
    """(model, tokenizer or None, meta) from a directory written by `save_checkpoint`."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = load_config(path / CONFIG_FILE)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} is missing: not a glasslm checkpoint?")
    try:
        weights = load_file(weights_path, device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{weights_path} is not a readable safetensors file ({err}); truncated or corrupt?") from None
    model = TransformerLM(config).to(device)
    load_weights(model, weights, source=str(weights_path))
    tokenizer = None
    if any((path / name).exists() for name in ("tokenizer.json", "glasslm_tokenizer.json")):
        tokenizer = load_tokenizer(path)
    meta_path = path / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return model, tokenizer, meta


def load_config(path: Path) -> ModelConfig:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a glasslm checkpoint?")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a glasslm model config")
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path} is not a glasslm model config: {err}") from None


def load_weights(model: TransformerLM, weights: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Copy `weights` into `model`, naming any missing, unexpected or mis-shaped tensor."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, model expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights)

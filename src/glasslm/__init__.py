"""glasslm: a decoder-only transformer language model you can read line by line.

The main names are here; each lives in its own module (see the README's "Where things are").
`glasslm.train` is the training module; its entry point is exported as `glasslm.train_model`.

Example:
    >>> import glasslm
    >>> tokenizer = glasslm.get_tokenizer("char", text="to be or not to be")
    >>> model = glasslm.TransformerLM(glasslm.get_preset("shakespeare-char-cpu", vocab_size=tokenizer.vocab_size))
    >>> len(glasslm.generate_text(model.eval(), tokenizer, "to be", max_new_tokens=5, seed=0))
    5
    >>> glasslm.get_recipe("shakespeare-char").max_steps  # each preset's training recipe
    5000
"""

import importlib as _importlib
import sys as _sys
from importlib import metadata as _metadata

from .checkpoint import load_checkpoint, save_checkpoint
from .core.config import PRESETS, ModelConfig, Preset, get_preset, get_recipe
from .generate import GenerationConfig, generate_text, generate_tokens, stream_text
from .interop import export_hf, import_hf, load_model
from .core.model import TransformerLM
from .tokenizers import get_tokenizer, load_tokenizer
# `glasslm.train` and `glasslm.generate` stay the modules (re-binding them to functions here would hide
# the modules from `import glasslm.train as m`); the training entry point is exported as `train_model`.
from .train import TrainConfig, TrainResult
from .train import train as train_model

# The core moved into glasslm.core; scripts written against the old flat paths
# (`from glasslm.config import get_preset`) keep working through these aliases.
for _name in ("config", "layers", "positions", "attention", "model"):
    _sys.modules[f"{__name__}.{_name}"] = _importlib.import_module(f".core.{_name}", __name__)

try:
    __version__ = _metadata.version("glasslm")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "GenerationConfig", "ModelConfig", "PRESETS", "Preset", "TrainConfig", "TrainResult", "TransformerLM",
    "__version__", "export_hf", "generate_text", "generate_tokens", "get_preset", "get_recipe",
    "get_tokenizer", "import_hf", "load_checkpoint", "load_model", "load_tokenizer", "save_checkpoint",
    "stream_text", "train_model",
]

"""glasslm: a decoder-only transformer language model you can read line by line.

The main names are here; each lives in its own module (see the README's "Where things are").
The training entry point is exported as `glasslm.train_model`.

Example:
    >>> import glasslm
    >>> tokenizer = glasslm.get_tokenizer("char", text="to be or not to be")
    >>> model = glasslm.TransformerLM(glasslm.get_preset("shakespeare-char-cpu", vocab_size=tokenizer.vocab_size))
    >>> len(glasslm.generate_text(model.eval(), tokenizer, "to be", max_new_tokens=5, seed=0))
    5
    >>> glasslm.get_recipe("shakespeare-char").max_steps  # each preset's training recipe
    5000
"""

from importlib import metadata as _metadata

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.generation import GenerationConfig, generate_text, generate_tokens, stream_text
from glasslm.hf import export_hf, import_hf, load_model
from glasslm.io.checkpoint import load_checkpoint, save_checkpoint
from glasslm.presets import PRESETS, Preset, get_preset
from glasslm.tokenizers import get_tokenizer, load_tokenizer
from glasslm.training.config import TrainConfig, get_recipe
from glasslm.training.result import TrainResult
from glasslm.training.loop import train as train_model

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

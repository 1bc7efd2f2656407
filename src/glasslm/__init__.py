"""glasslm: a decoder-only transformer language model you can read line by line.

The main names are here; each lives in its own module (see the README's "Where things are").
The training entry point is exported as `glasslm.train_model`. Each name is imported when first
used, so `from glasslm.hf import load_model` does not import the trainer too (a command's start,
and a model's load time, pay only for what they run).

Example:
    >>> import glasslm
    >>> tokenizer = glasslm.get_tokenizer("char", text="to be or not to be")
    >>> model = glasslm.TransformerLM(glasslm.get_preset("shakespeare-char-cpu", vocab_size=tokenizer.vocab_size))
    >>> len(glasslm.generate_text(model.eval(), tokenizer, "to be", max_new_tokens=5, seed=0))
    5
    >>> glasslm.get_recipe("shakespeare-char").max_steps  # each preset's training recipe
    5000
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, name there)
_NAMES = {
    "ModelConfig": ("glasslm.core.config", "ModelConfig"),
    "TransformerLM": ("glasslm.core.model", "TransformerLM"),
    **{n: ("glasslm.generation", n) for n in ("GenerationConfig", "generate_text", "generate_tokens", "stream_text")},
    **{n: ("glasslm.hf", n) for n in ("export_hf", "import_hf", "load_model")},
    **{n: ("glasslm.io.checkpoint", n) for n in ("load_checkpoint", "save_checkpoint")},
    **{n: ("glasslm.presets", n) for n in ("PRESETS", "Preset", "get_preset")},
    **{n: ("glasslm.tokenizers", n) for n in ("get_tokenizer", "load_tokenizer")},
    **{n: ("glasslm.training.config", n) for n in ("TrainConfig", "get_recipe")},
    "TrainResult": ("glasslm.training.result", "TrainResult"),
    "train_model": ("glasslm.training.loop", "train"),
}

__all__ = sorted([*_NAMES, "__version__"])


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib import metadata

        try:
            value = metadata.version("glasslm")
        except metadata.PackageNotFoundError:  # running from a source tree that was never installed
            value = "0.0.0+unknown"
    elif name in _NAMES:
        module, attribute = _NAMES[name]
        value = getattr(importlib.import_module(module), attribute)
    else:  # a subpackage (`import glasslm; glasslm.hf.load_model(...)` worked when everything was imported)
        try:
            value = importlib.import_module(f"glasslm.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"glasslm.{name}":
                raise
            raise AttributeError(f"module 'glasslm' has no attribute {name!r}") from None
    globals()[name] = value  # (looked up once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

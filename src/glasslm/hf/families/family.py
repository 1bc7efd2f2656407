"""What a Hugging Face family is to glasslm: everything one `families/<name>.py` file says.

Example:
    >>> from glasslm.hf.families import FAMILIES
    >>> FAMILIES["qwen2"].architecture
    'Qwen2ForCausalLM'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.gguf.form import GGUFForm
from glasslm.hf.plan import WeightTable


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """One HF architecture and how glasslm converts it both ways.

    name: the `model_type` written on export (and accepted on import, with `model_types`).
    architecture: the HF class in config.json's `architectures`.
    config_from_hf(hf_config, context_length) -> ModelConfig: raises UnsupportedModelError naming
        what does not fit; `context_length` (or None) overrides a rotary model's table length.
    config_to_hf(config, zero_biases) -> dict: this family's config.json keys (the caller adds
        `architectures`, `model_type`, special-token ids and `dtype`).
    fit_problems(config) -> list[str]: why a glasslm config is NOT this family ([] = it is); the
        recognizer `family_of` asks each registered family in turn.
    weight_table(config, hf_names) -> WeightTable: the tensor table for this config. `hf_names` are
        the tensor names of the file being imported (None on export), for families whose files
        name tensors in more than one way.
    ignored_tensors: a regex (fullmatch) for buffers old HF files saved that are recomputed here.
    model_types: further `model_type`s that mean this family on import.
    gguf: how llama.cpp's GGUF files write this family (None: they don't, or it reads as another
        family's: Mistral's files say "llama").
    """

    name: str
    architecture: str
    config_from_hf: Callable[[dict[str, Any], int | None], ModelConfig]
    config_to_hf: Callable[[ModelConfig, bool], dict[str, Any]]
    fit_problems: Callable[[ModelConfig], list[str]]
    weight_table: Callable[[ModelConfig, set[str] | None], WeightTable]
    ignored_tensors: str = r"(?!)"  # matches nothing
    model_types: tuple[str, ...] = ()
    gguf: GGUFForm | None = None

    def gguf_weight_table(self, config: ModelConfig) -> WeightTable:
        """The tensor table GGUF files of this family are read and written with (the HF one unless the
        GGUF form has its own)."""
        table = self.gguf.weight_table if self.gguf is not None and self.gguf.weight_table else self.weight_table
        return table(config, None)

    def reads(self, model_type: str | None) -> bool:
        """Whether an HF config with this `model_type` is this family."""
        return model_type == self.name or model_type in self.model_types

"""Hugging Face interop: GPT-2, Llama (incl. Llama 3 rope scaling), Mistral and Qwen2 models both
ways between glasslm and `transformers`, and one loader for any checkpoint.

Where things are: `convert` (import_hf, export_hf, hf_state_dict, the config dispatch), `families/`
(one file per HF family and the registry), `plan` (the weight-table engine), `tensors` (reading
safetensors / .bin shards lazily), `files` (HF's file names, config.json), `cache` (hub names in
the local HF cache), `hub` (downloads from the Hub, for `glasslm download`), `card` (the exported model card), `load` (load_model and friends),
`peft/` (LoRA adapters both ways with PEFT; a PEFT adapter directory loads with its base).

Example:
    >>> import tempfile
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> model = TransformerLM(get_preset("gpt2-small").replace(n_layers=1, d_model=64, n_heads=2))
    >>> family_of(model.config)
    'gpt2'
    >>> back, tokenizer = load_model(export_hf(model, tempfile.mkdtemp()))
    >>> back.config == model.config, tokenizer is None
    (True, True)
"""

from glasslm.hf.cache import resolve_model_path
from glasslm.hf.convert import config_from_hf, config_to_hf, export_hf, hf_state_dict, import_hf
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families import FAMILIES, family_of, register
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import adjacent_pairs_to_hf_rows, hf_rows_to_adjacent_pairs
from glasslm.hf.files import is_hf_directory, read_hf_config
from glasslm.hf.load import (
    checkpoint_config, checkpoint_summary, hf_tokenizer, init_weights_from, load_chat_template, load_model,
)

__all__ = [
    "FAMILIES", "HFFamily", "UnsupportedModelError", "adjacent_pairs_to_hf_rows", "checkpoint_config",
    "checkpoint_summary", "config_from_hf", "config_to_hf", "export_hf", "family_of", "hf_rows_to_adjacent_pairs",
    "hf_state_dict", "hf_tokenizer", "import_hf", "init_weights_from", "is_hf_directory", "load_chat_template",
    "load_model",
    "read_hf_config", "register", "resolve_model_path",
]

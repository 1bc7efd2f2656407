"""Models both ways between glasslm and Hugging Face `transformers`, for every registered family.

Import reads an HF directory (`config.json` plus `model.safetensors`, sharded safetensors with an
index, or `pytorch_model.bin`) and builds the matching `TransformerLM`; export writes a directory
that `transformers.AutoModelForCausalLM.from_pretrained` loads and that gives the same logits. What
differs per family (names, layouts, config keys) is the family's file in `glasslm.hf.families`.

Loading never holds two copies of the weights: the model is first built on the `meta` device
(shapes, no storage), then the checkpoint tensors — read memory-mapped — are *assigned* into it.
Buffers that are not saved (rotary cos/sin tables, the sinusoidal table) are then computed on the
real device by `materialize_buffers`.

Example:
    >>> import tempfile
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> out = export_hf(model, tempfile.mkdtemp())
    >>> back = import_hf(out)
    >>> all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    True
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.hf.cache import resolve_model_path
from glasslm.hf.card import model_card
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families import FAMILIES, HFFamily, family_for, family_reading
from glasslm.hf.families.common import missing_biases_refusal
from glasslm.hf.files import (
    GENERATION_CONFIG_FILE, GLASSLM_KEY, HF_CONFIG_FILE, MODEL_CARD_FILE, SAFETENSORS_FILE, read_hf_config,
)
from glasslm.hf.plan import WeightTable, hf_tensors, ours_makers
from glasslm.hf.tensors import TensorSource
from glasslm.io.build import model_from_state_dict

SPECIAL_TOKEN_ROLES = ("bos", "eos", "pad")


def config_from_hf(hf: dict[str, Any], context_length: int | None = None) -> tuple[ModelConfig, str]:
    """The ModelConfig equal to an HF `config.json` (as a dict), and which family it is.

    `context_length` overrides max_position_embeddings for rotary models (rotary tables are
    computed for that many positions; some configs advertise far more than you will use).

    >>> config, family = config_from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    >>> family, config.d_head, config.positional
    ('llama', 16, 'rope')
    """
    family = family_reading(hf.get("model_type"))
    if family is None:
        known = ", ".join(f.architecture for f in FAMILIES.values())
        raise UnsupportedModelError(
            f"unsupported architecture model_type={hf.get('model_type')!r} {hf.get('architectures') or []}: "
            f"glasslm converts {known}")
    return family.config_from_hf(hf, context_length), family.name


def config_to_hf(
    config: ModelConfig, dtype: torch.dtype = torch.float32, special_ids: dict[str, int | None] | None = None,
    zero_biases: bool = False,
) -> dict[str, Any]:
    """An HF `config.json` (as a dict) for a glasslm config of a supported family.

    `special_ids` ({"bos": id, "eos": id, "pad": id}, from the tokenizer) are written as given,
    None included: transformers fills absent GPT-2 ids with 50256, right only for GPT-2's own
    vocabulary. A bias-free GPT-2-shaped model needs `zero_biases=True` (see `export_hf`).

    >>> from glasslm.presets import get_preset
    >>> config_to_hf(get_preset("llama-tiny"))["architectures"]
    ['LlamaForCausalLM']
    """
    family = family_for(config)
    ids = {f"{role}_token_id": (special_ids or {}).get(role) for role in SPECIAL_TOKEN_ROLES}
    return {"architectures": [family.architecture], "model_type": family.name,
            **family.config_to_hf(config, zero_biases), **ids, "dtype": str(dtype).removeprefix("torch.")}


def _checked_table(family: HFFamily, config: ModelConfig, source: TensorSource) -> WeightTable:
    """The family's table for the file's tensor names, once every tensor is accounted for."""
    names = source.names()
    table = family.weight_table(config, names)
    ignorable = {n for n in names if re.fullmatch(family.ignored_tensors, n)} | (table.absent_biases & names)
    if config.tie_embeddings:
        ignorable.add("lm_head.weight")  # a tied model may carry a copy of the embedding; transformers re-ties it
    needed = table.hf_names()
    missing, unexpected = sorted(needed - names), sorted(names - needed - ignorable)
    if missing or unexpected:
        raise ValueError(
            f"{source.source} does not match a {family.name} model with this config.json: "
            f"missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}"
        )
    for name in sorted(table.absent_biases & names):
        if source.get(name).any():
            raise ValueError(
                f"{source.source}: {name} is not zero, but config.json's {GLASSLM_KEY!r} entry says the model "
                f"has no biases there; remove that entry to import the biases")
    return table


def import_hf(
    directory: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
    context_length: int | None = None,
) -> TransformerLM:
    """A glasslm model (eval mode) with the weights of the HF model in `directory`.

    `directory` may also be a hub name ("gpt2", "org/name") found in the local HF cache (see
    `resolve_model_path`; nothing is downloaded). `dtype` converts the weights (default: keep the
    checkpoint's); `context_length` overrides a rotary model's max_position_embeddings.
    `model.eos_token_ids` holds where generation stops, as in transformers (`hf_eos_token_ids`).
    """
    directory = resolve_model_path(directory)
    hf_config = read_hf_config(directory)
    config, name = config_from_hf(hf_config, context_length)
    source = TensorSource.from_directory(directory)
    table = _checked_table(FAMILIES[name], config, source)
    model = model_from_state_dict(config, ours_makers(table, source.get), device, dtype, source.source)
    model.eos_token_ids = hf_eos_token_ids(directory, hf_config)
    return model


def hf_eos_token_ids(directory: str | os.PathLike, hf_config: dict[str, Any] | None = None) -> tuple[int, ...]:
    """Where transformers' `generate` stops for the HF model in `directory`: generation_config.json's
    eos ids, else config.json's, else its tokenizer's eos (the tokenizer is read only then)."""
    from glasslm.tokenizers import eos_token_ids, read_generation_config, read_hf_tokenizer

    configs = (read_generation_config(directory), read_hf_config(directory) if hf_config is None else hf_config)
    if all(config.get("eos_token_id") is None for config in configs):
        return eos_token_ids(read_hf_tokenizer(directory))
    return eos_token_ids(None, *configs)


def hf_state_dict(model: TransformerLM, zero_biases: bool = False) -> dict[str, Tensor]:
    """The model's weights under HF names and layouts: the family's table read right to left.

    `zero_biases` fills the biases a bias-free GPT-2-shaped model lacks with zeros (HF GPT-2
    always has them); without it such a model is refused. A tied model saves only the embedding;
    transformers re-ties lm_head to it on load.
    """
    family = family_for(model.config)
    table = family.weight_table(model.config, None)
    if table.absent_biases and not zero_biases:
        raise missing_biases_refusal(family.architecture, sorted(table.absent_biases)[:4] + ["..."])
    ours = {name: t.detach() for name, t in model.state_dict().items()}
    return hf_tensors(table, ours, zero_biases)


def export_hf(
    model: TransformerLM, directory: str | os.PathLike, tokenizer: Any | None = None,
    meta: dict[str, Any] | None = None, *, zero_biases: bool = False, chat_template: str | None = None,
) -> Path:
    """Write `model` as an HF directory that `AutoModelForCausalLM` and `AutoTokenizer` load
    (with `chat_template`, `apply_chat_template` too).

    Files: config.json (with the tokenizer's real bos/eos/pad ids, None where it has none),
    model.safetensors, generation_config.json (eos: `model.eos_token_ids` where set), the tokenizer as tokenizer.json +
    tokenizer_config.json (a SentencePiece one as tokenizer.model), and a README.md model card
    built from `meta` (what `checkpoint_summary` returns: training data, steps, val loss).

    Raises UnsupportedModelError for architectures outside the registered families. HF GPT-2
    always has biases, so a bias-free GPT-2-shaped model (nanoGPT style, like the
    shakespeare-char presets) is refused unless `zero_biases=True`: then exact zeros are written,
    transformers computes the same logits, and config.json notes the model is bias-free so that
    `import_hf` gives the bias-free model back (same parameter count).
    """
    from safetensors.torch import save_file

    from glasslm.tokenizers import save_hf_tokenizer, special_token_ids
    from glasslm.transforms import applied_transforms

    if applied_transforms(model):  # Hugging Face's layers hold plain weights
        names = [t["name"] for t in applied_transforms(model)]
        raise ValueError(f"this model is transformed ({', '.join(names)}); export plain weights: for LoRA adapters, "
                         "glasslm merge --checkpoint CKPT --out DIR --to-hf (or only the adapters: convert --to-peft); "
                         "for int8/int4 weights, the checkpoint they were quantized from")
    special_ids = {k: v for k, v in special_token_ids(tokenizer).items() if k != "unk"}
    config_dict = config_to_hf(model.config, model.embed.weight.dtype, special_ids, zero_biases)
    # safetensors wants contiguous CPU tensors that share no memory with each other.
    weights = {name: t.contiguous().cpu().clone() for name, t in hf_state_dict(model, zero_biases).items()}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
    (path / HF_CONFIG_FILE).write_text(json.dumps(config_dict, indent=2))
    generation = {f"{role}_token_id": config_dict[f"{role}_token_id"] for role in SPECIAL_TOKEN_ROLES
                  if config_dict[f"{role}_token_id"] is not None}
    eos_ids = list(getattr(model, "eos_token_ids", None) or ())
    if eos_ids:  # where the model stops (an imported model's own ids), as transformers' generate reads them
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    (path / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, path, model.config.context_length, chat_template)
    (path / MODEL_CARD_FILE).write_text(model_card(model, tokenizer, meta, config_dict["model_type"]))
    return path

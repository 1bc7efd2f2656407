"""glasslm's adapters as a PEFT adapter directory for the model's exported HF base.

Every HF tensor a glasslm weight becomes (`layout.weight_parts`) that holds adapted rows gets an
adapter: our A rows of the blocks it holds, and B and the DoRA magnitudes taken at its rows (a row
no block adapts gets its weight row's norm: a DoRA factor of one). GPT-2's fused c_attn with q and
v adapted holds both blocks, so its rank is twice the others': `rank_pattern` and `alpha_pattern`
give it glasslm's scaling. Trained biases and whole modules are written under the names PEFT saves
them with (`base_layer` inside an adapted module; `modules_to_save`). Adapters on a mixture of
experts' stacks are written as peft's `target_parameters` ones (`experts.py`).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from glasslm.hf.families import family_for
from glasslm.hf.peft import experts
from glasslm.hf.peft.files import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, BASE_LAYER, PEFT_PREFIX
from glasslm.hf.peft.layout import HFPart, hf_table, our_weight, weight_parts
from glasslm.hf.plan import WeightTable
from glasslm.transforms.lora import (
    LoRAConfig, LoRAEmbedding, LoRAExperts, lora_layers, recorded_lora_config, trained_parameters,
)


def export_peft_adapter(model: nn.Module, directory: str | os.PathLike, base_model: str | None = None) -> Path:
    """Write `model`'s LoRA adapters (and what trains with them) as a PEFT adapter directory for its
    exported HF base; `base_model` is written as base_model_name_or_path."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("this model has no LoRA adapters to export")
    config = recorded_lora_config(model) or LoRAConfig()
    _check_experts_alone(layers)
    tensors: dict[str, Tensor] = {}
    ranks: dict[str, int] = {}
    transposed, table, expert_groups = False, hf_table(model), ()
    for name, layer in layers.items():
        if isinstance(layer, LoRAExperts):  # peft's target_parameters on the fused expert stacks
            tensors.update(experts.export_tensors(name, layer))
            expert_groups = layer.groups
            continue
        for module, (module_tensors, part) in _module_adapters(model, name, layer, table).items():
            tensors.update({f"{module}{suffix}": t for suffix, t in module_tensors.items()})
            ranks[module] = next(iter(module_tensors.values())).shape[0]
            transposed |= part.transposed and not isinstance(layer, LoRAEmbedding)
    whole = _trained_base_tensors(model, config, set(ranks))
    tensors.update(whole)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + k: v.detach().float().contiguous().cpu() for k, v in tensors.items()},
              folder / ADAPTER_WEIGHTS_FILE)
    scaling = next(iter(layers.values())).scaling
    peft_config = _peft_config(config, scaling, ranks, transposed, base_model, _modules_to_save(model, config))
    if expert_groups:
        peft_config["target_parameters"] = experts.target_parameters(expert_groups)
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(peft_config, indent=2))
    return folder


def _check_experts_alone(layers: dict[str, nn.Module]) -> None:
    """peft turns gate_proj / up_proj / down_proj target modules on a model with fused experts into expert
    target_parameters of its own (gate_up_proj at twice the rank), so dense MLP adapters beside expert ones
    (a Qwen3-MoE with dense layers between) would load as another adapter: refused by name."""
    dense = sorted(name for name in layers if re.search(r"\.mlp\.(gate|up|down)$", name))
    if dense and any(isinstance(layer, LoRAExperts) for layer in layers.values()):
        raise ValueError(f"adapters on both the experts and dense MLP layers ({', '.join(dense)}) cannot be written "
                         "for peft, which reads the dense layers' gate_proj / up_proj / down_proj as expert "
                         "parameters; adapt the experts on a model without dense MLP layers, or attention only")


PEFT_BASE_DIR = "base"  # where a glasslm base is exported inside a PEFT adapter directory


def export_peft_with_base(model: nn.Module, directory: str | os.PathLike, base: str) -> tuple[Path, str]:
    """(folder, the base it names) after writing `model`'s adapters as a PEFT adapter directory whose
    `base_model_name_or_path` transformers can load, so `AutoPeftModelForCausalLM.from_pretrained(folder)`
    works: a Hugging Face base directory's absolute path, a hub name as it is, and a glasslm base
    (which transformers cannot read) exported to `folder/base` first and named by its absolute path."""
    from glasslm.hf.convert import export_hf
    from glasslm.hf.files import is_hf_directory
    from glasslm.hf.load import load_chat_template, load_model

    folder, local = Path(directory), Path(base)
    if not local.exists():
        named = base  # a hub name
    elif is_hf_directory(local):
        named = str(local.resolve())
    else:
        base_model, tokenizer = load_model(local)
        # A bias-free GPT-2-shaped base gets exact zero biases (HF GPT-2 always has them; same logits).
        zero_biases = bool(family_for(base_model.config).weight_table(base_model.config, None).absent_biases)
        export_hf(base_model, folder / PEFT_BASE_DIR, tokenizer, zero_biases=zero_biases,
                  chat_template=load_chat_template(local, tokenizer))
        named = str((folder / PEFT_BASE_DIR).resolve())
    return export_peft_adapter(model, folder, base_model=named), named


def _module_adapters(model: nn.Module, name: str, layer: nn.Module,
                     table: WeightTable) -> dict[str, tuple[dict[str, Tensor], HFPart]]:
    """HF module -> ({tensor suffix: tensor}, its row map) for one of our adapters."""
    if isinstance(layer, LoRAEmbedding):
        part = weight_parts(model, "embed", table)[0]
        found = {".lora_embedding_A": layer.lora_a[0].detach(), ".lora_embedding_B": layer.lora_b[0].detach()}
        if layer.magnitude is not None:
            found[".lora_magnitude_vector"] = layer.magnitude[0].detach()
        return {part.module: (found, part)}
    rank, d_out = layer.lora_a[0].shape[0], layer.d_out
    a_all = torch.cat([a.detach() for a in layer.lora_a])                        # (blocks * rank, d_in)
    b_all = a_all.new_zeros(d_out, a_all.shape[0])                               # (d_out, blocks * rank)
    block_of_row = torch.full((d_out,), -1)
    for i, (start, end) in enumerate(layer.row_blocks):
        b_all[start:end, i * rank:(i + 1) * rank] = layer.lora_b[i].detach()
        block_of_row[start:end] = i
    magnitude = _row_magnitudes(model, name, layer)
    adapters = {}
    for part in weight_parts(model, name, table):
        blocks = sorted(set(block_of_row[part.rows].tolist()) - {-1})
        if not blocks:
            continue  # no adapted row lands in this HF tensor
        columns = torch.cat([torch.arange(i * rank, (i + 1) * rank) for i in blocks])
        found = {".lora_A.weight": a_all[columns], ".lora_B.weight": b_all[part.rows][:, columns]}
        if magnitude is not None:
            found[".lora_magnitude_vector"] = magnitude[part.rows]
        adapters[part.module] = (found, part)
    return adapters


def _row_magnitudes(model: nn.Module, name: str, layer: nn.Module) -> Tensor | None:
    """DoRA: each row's magnitude, a row no block adapts having its weight row's norm (a factor of one)."""
    if layer.magnitude is None:
        return None
    magnitude = torch.linalg.norm(our_weight(model, name).float(), dim=1)
    for (start, end), m in zip(layer.row_blocks, layer.magnitude):
        magnitude[start:end] = m.detach()
    return magnitude


def _trained_base_tensors(model: nn.Module, config: LoRAConfig, adapted: set[str]) -> dict[str, Tensor]:
    """The biases and whole modules that train with the adapters, under the HF names PEFT saves them with."""
    table, out = hf_table(model), {}
    for name, value in trained_parameters(model, config).items():
        if name.split(".")[-2] in ("lora_a", "lora_b", "magnitude"):
            continue
        ours = name.replace(".base.", ".")
        if ours not in table.entries:
            raise ValueError(f"{ours} trains with the adapters (bias={config.bias}) but has no Hugging Face "
                             "counterpart in this family, so PEFT could not load it")
        hf_names, _, to_hf = table.entries[ours]
        for hf_name, hf_value in zip(hf_names, to_hf(value.detach())):
            module, _, leaf = hf_name.rpartition(".")
            out[f"{module}{BASE_LAYER}.{leaf}" if module in adapted else hf_name] = hf_value
    return out


def _modules_to_save(model: nn.Module, config: LoRAConfig) -> list[str]:
    table = hf_table(model)
    return [table.entries[f"{name}.weight"][0][0].removesuffix(".weight") for name in config.full]


def _peft_config(config: LoRAConfig, scaling: float, ranks: dict[str, int], transposed: bool,
                 base_model: str | None, modules_to_save: list[str]) -> dict[str, Any]:
    """adapter_config.json: PEFT's scaling of every module equal to glasslm's. Modules of another rank
    than the most common (GPT-2's c_attn holding q and v) keep it through the patterns, whose keys
    PEFT reads as regular expressions (so written escaped)."""
    rank = Counter(ranks.values()).most_common(1)[0][0] if ranks else config.rank  # (experts alone: no modules)

    def alpha(r: int) -> float:
        return scaling * (r ** 0.5 if config.rslora else r)

    others = {module: r for module, r in ranks.items() if r != rank}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha(rank), "lora_dropout": config.dropout, "bias": config.bias,
        "target_modules": sorted(ranks), "fan_in_fan_out": transposed, "use_rslora": config.rslora,
        "use_dora": config.dora, "modules_to_save": modules_to_save or None,
        "rank_pattern": {re.escape(m): r for m, r in others.items()},
        "alpha_pattern": {re.escape(m): alpha(r) for m, r in others.items()},
    }

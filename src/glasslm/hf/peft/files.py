"""A PEFT LoRA adapter directory as files: `adapter_config.json` read and checked, and the tensors of
`adapter_model.safetensors` sorted by module and kind.

Every option of the config is either understood (the adapter's size and scaling, rsLoRA, DoRA,
biases, modules_to_save, rank and alpha patterns), known to change nothing in a loaded adapter (how
it was initialised, which modules were targeted: the tensors say that), or refused by name; so is
every tensor. Nothing is dropped silently.

Example:
    >>> match_pattern({r"layers\\.[01]\\.self_attn\\.q_proj": 11}, "model.layers.1.self_attn.q_proj", 5)
    11
    >>> match_pattern({"v_proj": 2}, "model.layers.1.self_attn.q_proj", 3)
    3
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"  # PEFT's name for the wrapped module inside an adapted one
# Inside a module in modules_to_save, PEFT may save the trained copy and the base's own module too.
TRAINED_COPY, ORIGINAL = ".modules_to_save", ".original_module"
# Tensor name endings -> what they are (PEFT saves them without the adapter's name).
ADAPTER_TENSORS = {".lora_A.weight": "a", ".lora_B.weight": "b", ".lora_embedding_A": "embedding_a",
                   ".lora_embedding_B": "embedding_b", ".lora_magnitude_vector": "magnitude"}

# Options that change nothing in an adapter once trained and saved: bookkeeping, initialisation,
# and which modules were targeted (the saved tensors say which were).
_NEUTRAL_OPTIONS = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "lora_dropout",
    "init_lora_weights", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
    "megatron_core", "runtime_config", "fan_in_fan_out",  # a module's layout is its type's (GPT-2's Conv1D)
}
_UNDERSTOOD_OPTIONS = {"r", "lora_alpha", "use_rslora", "use_dora", "bias", "modules_to_save", "rank_pattern",
                       "alpha_pattern", "ensure_weight_tying",
                       "target_parameters"}  # the experts' fused gate_up_proj / down_proj only (experts.py)
# Options glasslm does not implement, each with what it would have changed; refused when set.
_REFUSED_OPTIONS = {
    "lora_bias": "a bias on each lora_B", "layer_replication": "layers repeated from others",
    "trainable_token_indices": "trainable rows of the embedding", "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA's pooled inputs",
    "arrow_config": "Arrow routing between adapters", "megatron_config": "Megatron's parallel layers",
    "use_bdlora": "BD-LoRA", "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA", "kasa_config": "KaSA",
}


class PeftAdapterError(ValueError):
    """A PEFT adapter glasslm cannot load exactly (named, never loaded approximately)."""


@dataclass
class ModuleTensors:
    """The tensors PEFT saved for one adapted module: A, B and (DoRA) the magnitudes; embedding
    adapters keep PEFT's shapes, A (rank, vocab) and B (d_model, rank)."""

    a: Tensor | None = None
    b: Tensor | None = None
    magnitude: Tensor | None = None
    embedding: bool = False


@dataclass
class PeftAdapter:
    """An adapter directory's contents: `modules` maps an HF module name to its adapter tensors,
    `carried` maps HF tensor names to the base tensors PEFT loads over the base's (biases,
    modules_to_save, embedding tables), `original` the base's own tensors saved beside a trained
    copy (they must be the base's), and `config` is adapter_config.json."""

    source: str
    config: dict[str, Any]
    modules: dict[str, ModuleTensors] = field(default_factory=dict)
    carried: dict[str, Tensor] = field(default_factory=dict)
    original: dict[str, Tensor] = field(default_factory=dict)

    def scaling(self, module: str) -> float:
        """PEFT's scaling of one module: alpha / r (rsLoRA: alpha / sqrt(r)), each from its pattern if one matches."""
        rank = self.rank(module)
        alpha = match_pattern(self.config.get("alpha_pattern") or {}, module, self.config.get("lora_alpha", 8))
        return alpha / (math.sqrt(rank) if self.config.get("use_rslora") else rank)

    def rank(self, module: str) -> int:
        tensors = self.modules[module]
        return int(tensors.a.shape[0])

    @property
    def dora(self) -> bool:
        return bool(self.config.get("use_dora"))

    @property
    def bias(self) -> str:
        return self.config.get("bias") or "none"

    @property
    def modules_to_save(self) -> list[str]:
        return list(self.config.get("modules_to_save") or [])


def match_pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """The value of the first pattern matching `module`, as PEFT matches them (a regular expression
    for the end of the module's name, after a dot), else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def is_peft_directory(path: str | os.PathLike) -> bool:
    """True if `path` is a directory holding a PEFT adapter (adapter_config.json)."""
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    """adapter_config.json, checked: a LoRA adapter with no option glasslm would have to ignore."""
    folder = Path(directory)
    for needed in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not (folder / needed).is_file():
            raise FileNotFoundError(f"{folder} is not a PEFT adapter directory: {needed} is missing")
    try:
        config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise PeftAdapterError(f"{folder / ADAPTER_CONFIG_FILE} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise PeftAdapterError(f"{folder / ADAPTER_CONFIG_FILE} does not hold an adapter config")
    if config.get("peft_type", "LORA") != "LORA":
        raise PeftAdapterError(f"{folder}: glasslm reads LoRA adapters, this one is {config.get('peft_type')}")
    for key, value in config.items():
        if key in _NEUTRAL_OPTIONS or key in _UNDERSTOOD_OPTIONS or value in (None, False, {}, [], ""):
            continue
        what = _REFUSED_OPTIONS.get(key, "an option glasslm does not know")
        raise PeftAdapterError(f"{folder}: adapter_config.json sets {key}={value!r} ({what}), which glasslm "
                               "does not implement; it cannot load this adapter exactly")
    if config.get("bias", "none") not in ("none", "lora_only", "all"):
        raise PeftAdapterError(f"{folder}: adapter_config.json's bias={config['bias']!r} is not none, lora_only or all")
    return config


def read_peft_adapter(directory: str | os.PathLike) -> PeftAdapter:
    """The checked config and the sorted tensors of a PEFT LoRA adapter directory."""
    config = read_adapter_config(directory)
    adapter = PeftAdapter(str(directory), config)
    found: dict[str, dict[str, Tensor]] = defaultdict(dict)
    for key, tensor in load_file(Path(directory) / ADAPTER_WEIGHTS_FILE).items():
        if not key.startswith(PEFT_PREFIX):
            raise PeftAdapterError(f"{directory}: tensor {key!r} is not under {PEFT_PREFIX!r}, as PEFT saves them")
        name = key.removeprefix(PEFT_PREFIX)
        if name.endswith(".lora_B.bias"):
            raise PeftAdapterError(f"{directory}: {key} is a bias on lora_B (PEFT's lora_bias), which glasslm "
                                   "does not implement")
        ending = next((e for e in ADAPTER_TENSORS if name.endswith(e)), None)
        if ending is None:
            _carry(adapter, name, tensor.float())
        else:
            found[name.removesuffix(ending)][ADAPTER_TENSORS[ending]] = tensor.float()
    for module, parts in found.items():
        adapter.modules[module] = _module_tensors(str(directory), module, parts)
    if not adapter.modules and not adapter.carried:
        raise PeftAdapterError(f"{directory}: no adapter tensors found")
    return adapter


def _carry(adapter: PeftAdapter, name: str, tensor: Tensor) -> None:
    """File a base tensor under its module's own name: the trained copy of a module in
    modules_to_save as the module, the original beside it apart."""
    if ORIGINAL + "." in name:
        adapter.original[name.replace(ORIGINAL + ".", ".")] = tensor
        return
    name = name.replace(BASE_LAYER + ".", ".").replace(TRAINED_COPY + ".", ".")
    if name in adapter.carried and not torch.equal(adapter.carried[name], tensor):
        raise PeftAdapterError(f"{adapter.source}: two different tensors for {name} (the module and its trained copy)")
    adapter.carried[name] = tensor


def _module_tensors(source: str, module: str, parts: dict[str, Tensor]) -> ModuleTensors:
    embedding = "embedding_a" in parts or "embedding_b" in parts
    a, b = (parts.get("embedding_a"), parts.get("embedding_b")) if embedding else (parts.get("a"), parts.get("b"))
    if a is None or b is None or (embedding and ("a" in parts or "b" in parts)):
        raise PeftAdapterError(f"{source}: module {module} has tensors {sorted(parts)}, not one A and one B")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise PeftAdapterError(f"{source}: module {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                               "share a rank (only LoRA on linear maps and embeddings is read)")
    magnitude = parts.get("magnitude")
    if magnitude is not None and magnitude.shape != (b.shape[0],):
        raise PeftAdapterError(f"{source}: module {module}'s DoRA magnitudes {tuple(magnitude.shape)} do not "
                               f"match its {b.shape[0]} output features")
    return ModuleTensors(a, b, magnitude, embedding)

"""What a family looks like in a GGUF file: one `GGUFForm` per family, declared in the family's file.

llama.cpp's converter (convert_hf_to_gguf.py) writes a Hugging Face model as GGUF by renaming its
config.json keys to `{arch}.*` metadata, renaming its tensors (`model.layers.0.self_attn.q_proj.weight`
becomes `blk.0.attn_q.weight`) and changing a few tensors on the way (Llama's q/k rows are permuted,
GPT-2's Conv1D weights transposed, Gemma's norm gains stored as 1 + w). glasslm reads a GGUF file by
undoing exactly that, which gives back the HF form each family's weight table already reads: so the
maths of each layout stays in one place, the family's table. Tensor names are translated by the gguf
package's own map (`gguf.get_tensor_name_map`), the list llama.cpp converts with.

A form says, for one family: the architecture name (`general.architecture`), which metadata keys
are which config.json keys, the config entries no key says (`hf_extras`, e.g. biases read from
which tensors exist), and the tensor changes (`TensorFix`, both directions).

Example:
    >>> form = GGUFForm("llama", ROTARY_KEYS)
    >>> values = {"embedding_length": 64, "attention.head_count": 4, "block_count": 2, "rope.freq_base": 1e4}
    >>> hf = form.hf_config(values, set())
    >>> hf["hidden_size"], hf["num_attention_heads"], hf["rope_theta"]
    (64, 4, 10000.0)
    >>> form.gguf_values(hf)["embedding_length"]
    64
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from glasslm.hf.errors import UnsupportedModelError

# The metadata every Llama-shaped family writes (after "{arch}."), and the config.json key each is.
ROTARY_KEYS: dict[str, str] = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
# GGUF's rope scaling keys and the rope_parameters keys they are.
_ROPE_SCALING_KEYS = {"rope.scaling.factor": "factor", "rope.scaling.original_context_length": "original_max_position_embeddings",
                      "rope.scaling.yarn_beta_fast": "beta_fast", "rope.scaling.yarn_beta_slow": "beta_slow",
                      "rope.scaling.attn_factor": "attention_factor"}


@dataclasses.dataclass(frozen=True)
class TensorFix:
    """A change llama.cpp's converter makes to the HF tensors whose name fully matches `pattern`:
    `to_hf(tensor, hf_config)` undoes it (import), `to_gguf(tensor, hf_config)` makes it (export)."""

    pattern: str
    to_hf: Callable[[Tensor, Mapping[str, Any]], Tensor]
    to_gguf: Callable[[Tensor, Mapping[str, Any]], Tensor]

    def matches(self, hf_name: str) -> bool:
        return re.fullmatch(self.pattern, hf_name) is not None


def _no_extras(values: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    return {}


def _no_gguf_extras(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class GGUFForm:
    """One family in GGUF files.

    arch: `general.architecture` ("llama", "qwen2", "gpt2", ...).
    keys: `{arch}.<key>` -> config.json key, for values that are the same number in both.
    hf_extras(values, tensor_names) -> config.json entries the keys do not give (constants llama.cpp
        hard-codes for the architecture, biases read from which tensors the file holds, ...).
    gguf_extras(hf_config) -> `{arch}.<key>` values to write beyond `keys` (export).
    fixes: the tensor changes, matched on HF tensor names.
    experts: whether the form is the mixture-of-experts one of its architecture (llama.cpp's "llama" is
        Llama or, with `{arch}.expert_count`, Mixtral).
    weight_table(config, None) -> the family's table as GGUF files hold it, where not the HF one (MoE
        families: each projection of all experts one 3-D tensor, as llama.cpp's ffn_gate_exps).
    """

    arch: str
    keys: Mapping[str, str]
    hf_extras: Callable[[Mapping[str, Any], set[str]], dict[str, Any]] = _no_extras
    gguf_extras: Callable[[Mapping[str, Any]], dict[str, Any]] = _no_gguf_extras
    fixes: tuple[TensorFix, ...] = ()
    experts: bool = False
    weight_table: Callable[..., Any] | None = None

    def hf_config(self, values: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        """The config.json (as a dict, without model_type) that a file's `{arch}.*` `values` and
        tensors describe."""
        hf = {hf_key: values[key] for key, hf_key in self.keys.items() if key in values}
        scaling = rope_scaling_from_gguf(values)
        if scaling:
            hf["rope_scaling"] = scaling
        return {**hf, **self.hf_extras(values, tensor_names)}

    def gguf_values(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The `{arch}.*` values (without the prefix) to write for a config.json."""
        values = {key: hf[hf_key] for key, hf_key in self.keys.items() if hf.get(hf_key) is not None}
        values.update(rope_scaling_to_gguf(hf))
        return {**values, **self.gguf_extras(hf)}

    def to_hf(self, hf_name: str, tensor: Tensor, hf: Mapping[str, Any]) -> Tensor:
        for fix in self.fixes:
            if fix.matches(hf_name):
                tensor = fix.to_hf(tensor, hf)
        return tensor

    def to_gguf(self, hf_name: str, tensor: Tensor, hf: Mapping[str, Any]) -> Tensor:
        for fix in reversed(self.fixes):
            if fix.matches(hf_name):
                tensor = fix.to_gguf(tensor, hf)
        return tensor


# The rope_scaling types llama.cpp runs from metadata alone, as glasslm computes them. (Llama 3's
# scaling travels as a tensor, rope_freqs: `rope_factors`; longrope needs per-pair tensors too.)
_GGUF_ROPE_SCALINGS = ("linear", "yarn")


def rope_scaling_from_gguf(values: Mapping[str, Any]) -> dict[str, Any]:
    """HF `rope_scaling` from GGUF's rope scaling keys ({} where the file has none, or "none")."""
    kind = values.get("rope.scaling.type", "none")
    if kind in (None, "none"):
        return {}
    if kind not in _GGUF_ROPE_SCALINGS:
        raise UnsupportedModelError(f"rope.scaling.type {kind!r} is not supported (glasslm reads "
                                    f"{', '.join(_GGUF_ROPE_SCALINGS)} and Llama 3's rope_freqs)")
    if "rope.scaling.factor" not in values:
        raise ValueError(f"rope.scaling.type is {kind!r} but the file states no rope.scaling.factor")
    scaling = {"rope_type": kind}
    scaling.update({hf_key: values[key] for key, hf_key in _ROPE_SCALING_KEYS.items() if key in values})
    return scaling


def rope_scaling_to_gguf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """GGUF's rope scaling keys for an HF config's (global) rope parameters ({} for plain rotary).
    Llama 3's scaling is the exporter's rope_freqs tensor; only its original context is said here
    (llama.cpp reads it for YaRN alone), so that the divisors read back to the same four numbers."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return {}
    if kind == "llama3":
        return {"rope.scaling.original_context_length": params["original_max_position_embeddings"]}
    if kind not in _GGUF_ROPE_SCALINGS:
        raise UnsupportedModelError(f"llama.cpp has no {kind!r} rope scaling (it runs {', '.join(_GGUF_ROPE_SCALINGS)} "
                                    "and Llama 3's)")
    values: dict[str, Any] = {"rope.scaling.type": kind}
    values.update({key: params[hf_key] for key, hf_key in _ROPE_SCALING_KEYS.items() if params.get(hf_key) is not None})
    return values


def has_tensor(tensor_names: set[str], gguf_name: str) -> bool:
    """Whether the file holds `gguf_name` (as "blk.0.attn_q.bias": the first block decides for all)."""
    return gguf_name in tensor_names

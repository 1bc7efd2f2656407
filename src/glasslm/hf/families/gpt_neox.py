"""GPT-NeoX (`GPTNeoXForCausalLM`, model_type "gpt_neox": Pythia, the interpretability workhorse):
LayerNorms with biases, attention and MLP in parallel off the same input (`use_parallel_residual`),
rotary positions on the first quarter of each head's features (`rotary_pct`), an exact-GELU MLP,
biases everywhere, an untied output, and one query_key_value projection laid out head by head
([q0 k0 v0 | q1 k1 v1 | ...]). A glasslm config is a GPT-NeoX if it has that shape.

Example:
    >>> from glasslm.presets import get_preset
    >>> config = get_preset("pythia-160m")
    >>> FAMILY.fit_problems(config), config.rotary_dims, config.parallel_residual
    ([], 16, True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import bias_flags, block_shape_problems, missing_biases_refusal, rope_from_hf, rope_to_hf
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.gpt2 import ACTIVATION_NAMES, HF_ACTIVATIONS
from glasslm.hf.families.rotary import adjacent_pairs_to_hf_rows, hf_rows_to_adjacent_pairs
from glasslm.hf.gguf.form import GGUFForm, TensorFix
from glasslm.hf.plan import SAME, Plan, WeightTable


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    act = hf.get("hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise UnsupportedModelError(f"gpt_neox hidden_act {act!r} is not supported")
    if not hf.get("attention_bias", True):
        raise UnsupportedModelError("gpt_neox without attention biases is not supported")
    d_model, n_heads = hf.get("hidden_size", 6144), hf.get("num_attention_heads", 64)
    rope = {**hf, "rope_parameters": {"partial_rotary_factor": hf.get("rotary_pct", 0.25),
                                      "rope_theta": hf.get("rotary_emb_base", 10000.0),
                                      **(hf.get("rope_parameters") or hf.get("rope_scaling") or {})}}
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 50432), context_length=context_length or hf.get("max_position_embeddings", 2048),
        d_model=d_model, n_layers=hf.get("num_hidden_layers", 44), n_heads=n_heads,
        d_mlp=hf.get("intermediate_size", 4 * d_model), positional="rope", norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-5), activation=HF_ACTIVATIONS[act], mlp="mlp", bias=True,
        parallel_residual=bool(hf.get("use_parallel_residual", True)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0,
        **rope_from_hf(rope, d_model // n_heads))


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    c, flags = config, bias_flags(config)
    missing = [site for site, on in flags.items() if not on]
    if missing:
        raise missing_biases_refusal("GPT-NeoX", missing)
    rope = rope_to_hf(c)
    rope["rope_parameters"].setdefault("partial_rotary_factor", 1.0)
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "intermediate_size": c.d_mlp, "hidden_act": ACTIVATION_NAMES[c.activation],
        "max_position_embeddings": c.context_length, "layer_norm_eps": c.norm_eps,
        "use_parallel_residual": c.parallel_residual, "attention_bias": True,
        "tie_word_embeddings": c.tie_embeddings, **rope,
    }


def fit_problems(config: ModelConfig) -> list[str]:
    c, problems = config, block_shape_problems(config)
    wanted = dict(positional="rope", norm="layernorm", mlp="mlp", n_kv_heads=c.n_heads, d_head=c.d_model // c.n_heads,
                  sliding_window=None, qk_norm=False, post_norms=False)
    problems += [f"{name}={getattr(c, name)!r} (GPT-NeoX: {value!r})" for name, value in wanted.items()
                 if getattr(c, name) != value]
    if c.activation not in ACTIVATION_NAMES:
        problems.append(f"activation {c.activation!r} has no GPT-NeoX counterpart")
    if not all(bias_flags(c).values()):
        problems.append("missing biases (GPT-NeoX has them everywhere)")
    return problems


def qkv_conversions(config: ModelConfig):
    """(HF's per-head [q k v] rows -> our [all q | all k | all v], q/k rows in adjacent-pair order; and back)."""
    heads, d_head, r = config.n_heads, config.d_head, config.rotary_dims

    def to_ours(fused: Tensor) -> Tensor:
        per_head = fused.reshape(heads, 3, d_head, -1)  # (heads, q/k/v, d_head, d_in or 1 for the bias)
        q, k, v = (per_head[:, i].reshape(heads * d_head, -1) for i in range(3))
        out = torch.cat([hf_rows_to_adjacent_pairs(q, heads, r), hf_rows_to_adjacent_pairs(k, heads, r), v])
        return out.reshape(fused.shape)

    def to_hf(ours: Tensor) -> tuple[Tensor]:
        q, k, v = ours.reshape(3, heads * d_head, -1)
        q, k = adjacent_pairs_to_hf_rows(q, heads, r), adjacent_pairs_to_hf_rows(k, heads, r)
        per_head = torch.stack([t.reshape(heads, d_head, -1) for t in (q, k, v)], dim=1)  # (heads, 3, d_head, ...)
        return (per_head.reshape(ours.shape),)

    return to_ours, to_hf


def weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    qkv = qkv_conversions(config)
    plan: Plan = {"embed.weight": (("gpt_neox.embed_in.weight",), *SAME)}
    names = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "attn.out": "attention.dense",
             "mlp.up": "mlp.dense_h_to_4h", "mlp.down": "mlp.dense_4h_to_h"}
    for i in range(config.n_layers):
        hf, ours = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            plan[ours + f"attn.qkv.{kind}"] = ((hf + f"attention.query_key_value.{kind}",), *qkv)
            for our_name, hf_name in names.items():
                plan[ours + f"{our_name}.{kind}"] = ((hf + f"{hf_name}.{kind}",), *SAME)
    for kind in ("weight", "bias"):
        plan[f"ln_final.{kind}"] = ((f"gpt_neox.final_layer_norm.{kind}",), *SAME)
    if not config.tie_embeddings:
        plan["unembed.weight"] = (("embed_out.weight",), *SAME)
    return WeightTable(plan)


def _qkv_blocks(to_hf: bool):
    """llama.cpp stores query_key_value as [all q | all k | all v] (its converter regroups HF's
    per-head [q0 k0 v0 | q1 k1 v1 | ...]); biases alike."""

    def regroup(t: Tensor, hf: Any) -> Tensor:
        heads = hf["num_attention_heads"]
        grouped = (3, heads) if to_hf else (heads, 3)
        return t.reshape(*grouped, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    return regroup


def _neox_from_gguf(values: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    head_dim = values["embedding_length"] // values["attention.head_count"]
    rotated = values.get("rope.dimension_count", head_dim)
    return {"hidden_act": "gelu", "use_parallel_residual": bool(values.get("use_parallel_residual", True)),
            "rope_parameters": {"rope_theta": float(values.get("rope.freq_base", 10000.0)),
                                "partial_rotary_factor": rotated / head_dim}}


def _neox_to_gguf(hf: dict[str, Any]) -> dict[str, Any]:
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    rope = hf["rope_parameters"]
    return {"rope.dimension_count": round(head_dim * rope["partial_rotary_factor"]), "rope.freq_base": rope["rope_theta"],
            "use_parallel_residual": hf["use_parallel_residual"]}


GGUF = GGUFForm(
    "gptneox", {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
                "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
                "attention.head_count": "num_attention_heads", "attention.layer_norm_epsilon": "layer_norm_eps"},
    hf_extras=_neox_from_gguf, gguf_extras=_neox_to_gguf,
    fixes=(TensorFix(r"gpt_neox\.layers\.\d+\.attention\.query_key_value\.(weight|bias)",
                     _qkv_blocks(to_hf=True), _qkv_blocks(to_hf=False)),))

FAMILY = HFFamily(
    name="gpt_neox", architecture="GPTNeoXForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=weight_table,
    # Old checkpoints saved the causal mask and rotary frequencies as buffers.
    ignored_tensors=r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)", gguf=GGUF,
)

"""What the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) share: their config keys and
their expert tensors.

Hugging Face checkpoints store each expert as its own three matrices
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, Mixtral: `block_sparse_moe.experts.{e}.w1.weight`);
glasslm stacks them into one (n_experts, d_out, d_in) tensor per projection (`core/moe.py`). The table
entries read the n matrices and stack them (import) and cut the stack back apart (export).
transformers >= 5 fuses them in memory as `mlp.experts.gate_up_proj` ((n, 2 d_expert, d_model)) and
`mlp.experts.down_proj`; files written that way are read too.

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> config = ModelConfig(d_model=8, n_heads=2, n_layers=1, mlp="swiglu", n_experts=2, d_expert=4)
    >>> table = expert_entries(config, 0, HF_NAMES["mlp"], None)
    >>> table["blocks.0.mlp.gate"][0]
    ('model.layers.0.mlp.experts.0.gate_proj.weight', 'model.layers.0.mlp.experts.1.gate_proj.weight')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import EXPERTS_PROBLEM
from glasslm.hf.plan import SAME, Plan, WeightTable

# Each layout's names under model.layers.{i}.: the MoE module, the router, and the three projections.
HF_NAMES = {
    "mlp": ("mlp", "gate", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", "gate", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def _stack(*experts: Tensor) -> Tensor:
    return torch.stack(experts)  # (n_experts, d_out, d_in)


def _unstack(stacked: Tensor) -> tuple[Tensor, ...]:
    return tuple(stacked.unbind(0))


def expert_entries(config: ModelConfig, layer: int, names: tuple[str, str, dict[str, str]],
                   hf_names: set[str] | None) -> Plan:
    """The table entries of layer `layer`'s experts and router (and shared expert, if the config has one)."""
    module, router, projections = names
    hf, ours = f"model.layers.{layer}.{module}.", f"blocks.{layer}.mlp."
    plan: Plan = {ours + "router.weight": ((hf + f"{router}.weight",), *SAME)}
    fused = hf_names is not None and hf + "experts.gate_up_proj" in hf_names
    for proj, hf_proj in projections.items():
        if fused and proj != "down":  # transformers 5's in-memory layout: [gate | up] on axis 1
            half = config.d_expert or config.d_mlp
            cut = slice(0, half) if proj == "gate" else slice(half, 2 * half)
            plan[ours + proj] = ((hf + "experts.gate_up_proj",), lambda t, cut=cut: t[:, cut], _unfusable)
        elif fused:
            plan[ours + proj] = ((hf + "experts.down_proj",), *SAME)
        else:
            plan[ours + proj] = (tuple(hf + f"experts.{e}.{hf_proj}.weight" for e in range(config.n_experts)),
                                 _stack, _unstack)
    if config.d_shared_expert is not None:
        for proj, hf_proj in projections.items():
            plan[ours + f"shared.{proj}.weight"] = ((hf + f"shared_expert.{hf_proj}.weight",), *SAME)
        plan[ours + "shared_gate.weight"] = ((hf + "shared_expert_gate.weight",), *SAME)
    return plan


def _unfusable(t: Tensor) -> tuple[Tensor]:
    raise AssertionError("export writes experts one by one (the checkpoint layout), never fused")


def with_experts(plan: Plan, config: ModelConfig, names: tuple[str, str, dict[str, str]],
                 hf_names: set[str] | None) -> Plan:
    """A dense table (`rotary_weight_table`'s) with each MoE layer's MLP entries replaced by its experts'."""
    for layer in range(config.n_layers):
        if config.moe_layer(layer):
            for proj in ("gate", "up", "down"):
                plan.pop(f"blocks.{layer}.mlp.{proj}.weight")
            plan.update(expert_entries(config, layer, names, hf_names))
    return plan


def experts_from_hf(hf: dict[str, Any], family: str, n_experts_key: str) -> dict[str, Any]:
    """The ModelConfig expert fields of an HF MoE config (Qwen's keys). The Hub's files name the number of
    experts `n_experts_key` (Qwen: num_experts, Mixtral: num_local_experts); transformers 5 saves
    num_local_experts for every family."""
    if hf.get("mlp_only_layers"):
        raise UnsupportedModelError(f"{family} with dense layers listed in mlp_only_layers "
                                    f"({hf['mlp_only_layers']}) is not supported (decoder_sparse_step is)")
    n_experts = hf.get(n_experts_key, hf.get("num_local_experts", 8))
    if not n_experts:
        raise UnsupportedModelError(f"{family} with {n_experts_key}={n_experts!r} (no experts) is not supported")
    return dict(n_experts=n_experts, experts_per_token=hf.get("num_experts_per_tok", 2),
                moe_every=hf.get("decoder_sparse_step", 1),
                moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def experts_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json keys every MoE family writes (Qwen's names; each family adds or renames its own)."""
    c = config
    return {"num_experts": c.n_experts, "num_experts_per_tok": c.experts_per_token,
            "moe_intermediate_size": c.d_expert or c.d_mlp, "decoder_sparse_step": c.moe_every,
            "norm_topk_prob": c.router_renormalize, "mlp_only_layers": [], "router_aux_loss_coef": c.moe_aux_loss_coef}


def expert_problems(config: ModelConfig, shared: bool = False, every_layer: bool = False) -> list[str]:
    """Why a config's experts are not a family's: none, a shared expert it lacks (or lacks one it has)."""
    c, problems = config, []
    if c.n_experts == 0:
        problems.append("no experts (a dense model)")
        return problems
    if (c.d_shared_expert is not None) != shared:
        problems.append("a shared expert" if c.d_shared_expert is not None else "no shared expert")
    if every_layer and c.moe_every != 1:
        problems.append(f"experts every {c.moe_every} layers (every layer only)")
    return problems


def without_experts_problem(problems: list[str]) -> list[str]:
    """A dense family's objections less the one to experts (what the MoE family built on it has)."""
    return [p for p in problems if p != EXPERTS_PROBLEM]


# --------------------------------------------------------------------------------------------- GGUF

def gguf_expert_table(hf_table: Any, names: tuple[str, str, dict[str, str]], arch: str) -> Any:
    """A MoE family's table as GGUF files hold it: `hf_table`'s, with each projection of all of a layer's
    experts ONE tensor (llama.cpp's ffn_gate_exps / ffn_up_exps / ffn_down_exps, (n_experts, d_out, d_in)
    as ours), under the merged name llama.cpp's converter gives it (`...experts.gate_proj.weight`)."""
    module, _, projections = names

    def table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
        _every_layer(config.moe_every, arch)
        plan = dict(hf_table(config, None).entries)
        for layer in range(config.n_layers):
            if config.moe_layer(layer):
                for proj, hf_proj in projections.items():
                    plan[f"blocks.{layer}.mlp.{proj}"] = ((f"model.layers.{layer}.{module}.experts.{hf_proj}.weight",),
                                                          *SAME)
        return WeightTable(plan)

    return table


def experts_from_gguf(values: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's expert keys from a file's `{arch}.expert_*` values (each family reads its own)."""
    count = values.get("expert_count")
    hf = {"num_experts": count, "num_local_experts": count, "num_experts_per_tok": values.get("expert_used_count"),
          "moe_intermediate_size": values.get("expert_feed_forward_length"),
          "shared_expert_intermediate_size": values.get("expert_shared_feed_forward_length"),
          "decoder_sparse_step": 1}  # llama.cpp's MoE architectures have experts on every layer
    return {key: value for key, value in hf.items() if value is not None}


def experts_to_gguf(hf: Mapping[str, Any], arch: str, renormalized: bool) -> dict[str, Any]:
    """A file's `{arch}.expert_*` values for a config.json, or UnsupportedModelError naming what llama.cpp's
    `arch` cannot run: experts on some layers only, or (un)normalised weights it does not compute."""
    _every_layer(hf.get("decoder_sparse_step", 1), arch)
    if bool(hf.get("norm_topk_prob", renormalized)) != renormalized:
        raise UnsupportedModelError(f"llama.cpp's {arch} {'renormalises' if renormalized else 'does not renormalise'} "
                                    f"the chosen experts' weights; this model {'does not' if renormalized else 'does'}")
    values = {"expert_count": hf.get("num_experts") or hf.get("num_local_experts"),
              "expert_used_count": hf["num_experts_per_tok"],
              "expert_feed_forward_length": hf.get("moe_intermediate_size"),
              "expert_shared_feed_forward_length": hf.get("shared_expert_intermediate_size")}
    return {key: value for key, value in values.items() if value is not None}


def _every_layer(moe_every: int, arch: str) -> None:
    if moe_every != 1:
        raise UnsupportedModelError(f"llama.cpp's {arch} has experts on every layer; this model has them every "
                                    f"{moe_every} layers")

"""Where each HF module's rows sit in glasslm's weights, read off the family's weight table.

Export turns one glasslm weight into HF tensors by rearranging its rows: q/k rows reordered for
rotary models, q/k/v split into three projections (Llama) or kept fused (GPT-2's c_attn, stored
transposed as a Conv1D; GPT-NeoX's, interleaved per head). An adapter's update B A and its DoRA
magnitudes change rows as the weight's rows change, so B and the magnitudes follow the same row
map, and A stays. The map is found by sending row numbers through the table's export function, then
checked on the real weight: a conversion that is not a row rearrangement is refused.

Example:
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> model = TransformerLM(get_preset("llama-tiny", n_layers=1))
    >>> parts = weight_parts(model, "blocks.0.attn.qkv")
    >>> [p.module.split(".")[-1] for p in parts], [len(p.rows) for p in parts], parts[0].transposed
    (['q_proj', 'k_proj', 'v_proj'], [128, 32, 32], False)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glasslm.hf.families import family_for
from glasslm.hf.plan import WeightTable
from glasslm.transforms.lora import LoRALinear, base_weight

_PROBE_COLUMNS = 3  # row numbers in column 0; more columns tell a transposed tensor apart


@dataclass(frozen=True)
class HFPart:
    """One HF tensor made from a glasslm weight: its module's name, which of our rows it holds, in
    its order (its row i is our row rows[i]), and whether it is stored (d_in, rows) (a Conv1D)."""

    module: str
    rows: Tensor
    transposed: bool


def hf_table(model: nn.Module) -> WeightTable:
    """The family's weight table for `model`, as if untied: a tied model's unembedding then has its
    HF name (lm_head) for adapters and modules_to_save."""
    config = model.config.replace(tie_embeddings=False) if model.config.tie_embeddings else model.config
    return family_for(config).weight_table(config)


def our_weight(model: nn.Module, name: str) -> Tensor:
    """The (d_out, d_in) weight of glasslm module `name`, dequantized if need be: "embed" is the table
    transposed (the map from a one-hot token), and a tied "unembed" the table itself."""
    if name == "embed":
        return model.embed.weight.detach().T
    module = model.embed if name == "unembed" and model.unembed is None else model.get_submodule(name)
    return base_weight(module.base if isinstance(module, LoRALinear) else module).detach()


def weight_parts(model: nn.Module, name: str, table: WeightTable | None = None) -> list[HFPart]:
    """The HF tensors glasslm module `name`'s weight becomes, each with its row map (`table`: the
    model's `hf_table`, when the caller has it already)."""
    table = table or hf_table(model)
    key = f"{name}.weight"
    if key not in table.entries:
        raise ValueError(f"glasslm's {name} has no Hugging Face counterpart in this family's table")
    hf_names, _, to_hf = table.entries[key]
    weight = our_weight(model, name)
    if name == "embed":  # stored (vocab, d_model), the map's weight transposed; its rows are d_model's
        if not torch.equal(to_hf(weight.T[:, :_PROBE_COLUMNS])[0], weight.T[:, :_PROBE_COLUMNS]):
            raise ValueError("this family stores the embedding table rearranged; its adapters cannot be mapped")
        return [HFPart(hf_names[0].removesuffix(".weight"), torch.arange(weight.shape[0]), True)]
    columns = torch.arange(_PROBE_COLUMNS, dtype=torch.float64)
    probe = torch.arange(weight.shape[0], dtype=torch.float64)[:, None] - columns / _PROBE_COLUMNS  # (d_out, 3)
    sample = weight[:, :_PROBE_COLUMNS]  # checked on the real weight's first columns
    parts = []
    for hf_name, moved, real in zip(hf_names, to_hf(probe), to_hf(sample.clone())):
        transposed = moved.shape[0] == _PROBE_COLUMNS and moved.shape[1] != _PROBE_COLUMNS
        rows = (moved.T if transposed else moved)[:, 0].round().long()
        if not torch.equal(real.T if transposed else real, sample[rows]):
            raise ValueError(f"the conversion of {key} to {hf_name} is not a row rearrangement; "
                             "adapters cannot follow it")
        parts.append(HFPart(hf_name.removesuffix(".weight"), rows, transposed))
    return parts

"""A model's weights stacked over layers in TransformerLens's layout and names: `W_Q(model)` is what a
TransformerLens user reads as `model.W_Q`; `OV(model)` and `QK(model)` are the circuits as
`FactoredMatrix`es. `glasslm.interp.hooked.HookedModel` has them all as properties.

| name | shape | from |
|---|---|---|
| `W_E` | vocab d_model | the embedding table (unscaled: Gemma's hook_embed is W_E[tokens] * sqrt(d_model)) |
| `W_pos` | context d_model | a learned or sinusoidal position table (rotary models have none) |
| `W_Q`, `b_Q` | layers heads d_model d_head, layers heads d_head | the query part of each block's qkv |
| `W_K`, `W_V`, `b_K`, `b_V` | layers kv_heads d_model d_head, ... | keys and values (n_kv_heads heads, as TransformerLens's) |
| `W_O`, `b_O` | layers heads d_head d_model, layers d_model | the out projection, split by head |
| `W_in`, `W_gate`, `b_in` | layers d_model d_mlp, layers d_mlp | the MLP's up (and SwiGLU's gate) projection |
| `W_out`, `b_out` | layers d_mlp d_model, layers d_model | the MLP's down projection |
| `W_U`, `b_U` | d_model vocab, vocab | the unembedding (the embedding, transposed, when tied) |

These are views where the layout allows, else copies: edit the model's own parameters, not them.
A bias the model lacks reads as zeros (TransformerLens 4's bridge raises instead). Rotary models
keep glasslm's feature order within a head (adjacent pairs; see docs/inspection.md).

`QK(model)` is W_Q @ W_K.T per head (layers, heads, d_model, d_model), the key heads repeated for
grouped-query attention; `OV(model)` is W_V @ W_O. Like TransformerLens's, they leave out what sits
between the factors: rotary positions, and Gemma 3's / Qwen3's q/k norms.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny", n_layers=2))
    >>> W_Q(model).shape, W_K(model).shape  # llama-tiny: 8 query heads, 2 key/value heads
    (torch.Size([2, 8, 128, 16]), torch.Size([2, 2, 128, 16]))
    >>> OV(model).shape, OV(model).mdim
    (torch.Size([2, 8, 128, 128]), 16)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float
from torch import Tensor, nn

from glasslm.interp.factored import FactoredMatrix


def _qkv_part(attn: nn.Module, part: int) -> tuple[Tensor, Tensor | None]:
    """(weight (heads, d_head, d_model), bias (heads, d_head) or None) of q (0), k (1) or v (2)."""
    d_q, d_kv = attn.n_heads * attn.d_head, attn.n_kv_heads * attn.d_head
    start, size = [(0, d_q), (d_q, d_kv), (d_q + d_kv, d_kv)][part]
    weight = attn.qkv.weight[start:start + size].view(-1, attn.d_head, attn.qkv.weight.shape[1])
    bias = attn.qkv.bias
    return weight, None if bias is None else bias[start:start + size].view(-1, attn.d_head)


def _stack(model: nn.Module, get) -> Tensor:
    return torch.stack([get(block) for block in model.blocks])


def _weights(model: nn.Module, part: int) -> Float[Tensor, "layers heads d_model d_head"]:
    return _stack(model, lambda block: _qkv_part(block.attn, part)[0].transpose(-2, -1))


def _biases(model: nn.Module, part: int) -> Float[Tensor, "layers heads d_head"]:
    def bias(block: nn.Module) -> Tensor:
        weight, b = _qkv_part(block.attn, part)
        return weight.new_zeros(weight.shape[:2]) if b is None else b
    return _stack(model, bias)


def _qkv_stack(kind: str, part: int) -> Callable[[nn.Module], Tensor]:
    """W_Q, W_K, W_V (layers, heads or kv_heads, d_model, d_head) and b_Q, b_K, b_V (layers, heads, d_head)."""
    def stacked(model: nn.Module) -> Tensor:
        return _weights(model, part) if kind == "W" else _biases(model, part)
    stacked.__name__ = stacked.__qualname__ = f"{kind}_{'QKV'[part]}"
    stacked.__doc__ = f"{'Weights' if kind == 'W' else 'Biases'} of the {['queries', 'keys', 'values'][part]}, every layer."
    return stacked


W_Q, W_K, W_V = (_qkv_stack("W", part) for part in range(3))
b_Q, b_K, b_V = (_qkv_stack("b", part) for part in range(3))


def W_O(model: nn.Module) -> Float[Tensor, "layers heads d_head d_model"]:
    def per_head(block: nn.Module) -> Tensor:
        attn = block.attn
        return attn.out.weight.view(-1, attn.n_heads, attn.d_head).permute(1, 2, 0)  # (heads, d_head, d_model)
    return _stack(model, per_head)


def _bias_or_zeros(linear: nn.Module) -> Tensor:
    return linear.weight.new_zeros(linear.weight.shape[0]) if linear.bias is None else linear.bias


def b_O(model: nn.Module) -> Float[Tensor, "layers d_model"]:
    return _stack(model, lambda block: _bias_or_zeros(block.attn.out))


def _mlps(model: nn.Module) -> list[nn.Module]:
    mlps = [block.mlp for block in model.blocks]
    if any(mlp is None for mlp in mlps):
        raise ValueError("this model has attention-only blocks (mlp='none'): it has no MLP weights")
    return mlps


def W_in(model: nn.Module) -> Float[Tensor, "layers d_model d_mlp"]:
    return torch.stack([mlp.up.weight.T for mlp in _mlps(model)])


def W_gate(model: nn.Module) -> Float[Tensor, "layers d_model d_mlp"] | None:
    """SwiGLU's gate projection; None for a plain MLP (as TransformerLens)."""
    mlps = _mlps(model)
    return torch.stack([mlp.gate.weight.T for mlp in mlps]) if hasattr(mlps[0], "gate") else None


def b_in(model: nn.Module) -> Float[Tensor, "layers d_mlp"]:
    return torch.stack([_bias_or_zeros(mlp.up) for mlp in _mlps(model)])


def W_out(model: nn.Module) -> Float[Tensor, "layers d_mlp d_model"]:
    return torch.stack([mlp.down.weight.T for mlp in _mlps(model)])


def b_out(model: nn.Module) -> Float[Tensor, "layers d_model"]:
    return torch.stack([_bias_or_zeros(mlp.down) for mlp in _mlps(model)])


def W_E(model: nn.Module) -> Float[Tensor, "vocab d_model"]:
    return model.embed.weight


def W_pos(model: nn.Module) -> Float[Tensor, "context d_model"]:
    table = getattr(model.pos_embed, "weight", getattr(model.pos_embed, "table", None))  # learned, sinusoidal
    if table is None:
        raise ValueError(f"W_pos is a position table; this model's positions are {model.config.positional!r}")
    return table


def W_U(model: nn.Module) -> Float[Tensor, "d_model vocab"]:
    return (model.embed.weight if model.unembed is None else model.unembed.weight).T


def b_U(model: nn.Module) -> Float[Tensor, "vocab"]:
    bias = model.unembed_bias
    return model.embed.weight.new_zeros(model.config.vocab_size) if bias is None else bias


def _query_heads(model: nn.Module, kv: Tensor) -> Tensor:
    """Key/value heads repeated so query head h reads kv head h // (heads / kv_heads)."""
    return kv.repeat_interleave(model.config.n_heads // model.config.n_kv_heads, dim=1)


def QK(model: nn.Module) -> FactoredMatrix:
    """W_Q @ W_K.T of every head: (layers, heads, d_model, d_model), factored through d_head."""
    return FactoredMatrix(W_Q(model), _query_heads(model, W_K(model)).transpose(-2, -1))


def OV(model: nn.Module) -> FactoredMatrix:
    """W_V @ W_O of every head: (layers, heads, d_model, d_model), factored through d_head."""
    return FactoredMatrix(_query_heads(model, W_V(model)), W_O(model))

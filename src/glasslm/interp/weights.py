"""Weight processing, as TransformerLens does it on loading: four rewrites that leave log-probs unchanged.

* `fold_ln`: move each norm's gain (and LayerNorm's bias) into the weights that read its output,
  and centre those reading weights (LayerNorm's output has zero mean, so their mean is never seen);
  the norms are left with gain 1 and bias 0.
* `center_writing_weights`: subtract the mean over d_model from everything written to the
  residual stream (embeddings, attention and MLP out projections and biases). Every reader is a
  LayerNorm, which subtracts the mean anyway. LayerNorm models only.
* `center_unembed`: subtract each unembedding row's mean over the vocabulary (softmax ignores a
  constant added to every logit).
* `fold_value_biases`: each attention pattern row sums to 1, so the value bias always adds
  b_V @ W_O; fold it into the out bias.

`process_weights(model)` applies all four (TransformerLens's defaults). Each edits the model in
place, under no_grad. A tied unembedding is untied first (folding changes it, not the embedding).

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> torch.manual_seed(0) and None
    >>> model = TransformerLM(get_preset("gpt2-small", n_layers=2, d_model=64, n_heads=4, vocab_size=100)).eval()
    >>> tokens = torch.tensor([[1, 2, 3, 4]])
    >>> before = torch.log_softmax(model(tokens), -1)
    >>> process_weights(model)
    >>> torch.allclose(torch.log_softmax(model(tokens), -1), before, atol=1e-5)
    True
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glasslm.core.layers import LayerNorm, Linear


def _is_layernorm(norm: nn.Module | None) -> bool:
    return isinstance(norm, LayerNorm)


def _fold_norm_into(norm: nn.Module, readers: list[Linear]) -> None:
    """W' = W * gain (per input feature), b' = b + W @ norm_bias, reading weights centred for LayerNorm."""
    if getattr(norm, "unbiased_std", False):
        raise ValueError("fold_ln does not support norm_unbiased_std LayerNorm")
    gain = norm.weight.detach().clone()
    shift = getattr(norm, "bias", None)
    shift = None if shift is None else shift.detach().clone()
    for linear in readers:
        weight = linear.weight  # (d_out, d_model)
        if shift is not None:
            folded_bias = weight @ shift  # (d_out,)
            if linear.bias is None:
                linear.bias = nn.Parameter(folded_bias)
            else:
                linear.bias += folded_bias
        weight *= gain
        if _is_layernorm(norm):
            weight -= weight.mean(dim=1, keepdim=True)
    norm.weight.fill_(1.0)
    if shift is not None:
        norm.bias.zero_()


def untie_unembedding(model: nn.Module) -> None:
    """Give a tied model its own unembedding (a copy of the embedding) and a zero logit bias."""
    if model.unembed is None:
        vocab, d_model = model.embed.weight.shape
        model.unembed = Linear(d_model, vocab, bias=False).to(model.embed.weight)
        model.unembed.weight.copy_(model.embed.weight)
        model.config.tie_embeddings = False
    if model.unembed_bias is None:
        model.unembed_bias = nn.Parameter(torch.zeros_like(model.unembed.weight[:, 0]))
        model.config.unembed_bias = True


@torch.no_grad()
def fold_ln(model: nn.Module) -> None:
    """Fold every norm's gain and bias into the next weights (ln1 -> qkv, ln2 -> MLP in, ln_final -> unembed)."""
    if model.config.norm_placement != "pre":
        raise ValueError("fold_ln needs a pre-norm model (norm_placement='pre')")
    for block in model.blocks:
        _fold_norm_into(block.ln1, [block.attn.qkv])
        if block.mlp is not None:
            _fold_norm_into(block.ln2, [block.mlp.up] + ([block.mlp.gate] if hasattr(block.mlp, "gate") else []))
    if model.ln_final is not None:
        untie_unembedding(model)
        shift = getattr(model.ln_final, "bias", None)
        if shift is not None:
            model.unembed_bias += model.unembed.weight @ shift
            model.ln_final.bias.zero_()
        model.unembed.weight *= model.ln_final.weight
        if _is_layernorm(model.ln_final):
            model.unembed.weight -= model.unembed.weight.mean(dim=1, keepdim=True)
        model.ln_final.weight.fill_(1.0)


def _center(weight: Tensor, bias: Tensor | None) -> None:
    """Subtract the mean over the d_model output axis (dim 0 of a (d_model, d_in) weight)."""
    weight -= weight.mean(dim=0, keepdim=True)
    if bias is not None:
        bias -= bias.mean()


@torch.no_grad()
def center_writing_weights(model: nn.Module) -> None:
    """Make everything written to the residual stream mean-zero over d_model (LayerNorm models)."""
    norms = [model.ln_final, *(n for b in model.blocks for n in (b.ln1, b.ln2) if n is not None)]
    if not all(_is_layernorm(norm) for norm in norms):
        raise ValueError("center_writing_weights needs every norm to be a LayerNorm (and a final norm)")
    if model.config.tie_embeddings:
        untie_unembedding(model)  # first, so the unembedding keeps the uncentred table
    model.embed.weight -= model.embed.weight.mean(dim=1, keepdim=True)
    pos_table = getattr(model.pos_embed, "weight", None)
    if isinstance(pos_table, nn.Parameter):
        pos_table -= pos_table.mean(dim=1, keepdim=True)
    for block in model.blocks:
        _center(block.attn.out.weight, block.attn.out.bias)
        if block.mlp is not None:
            _center(block.mlp.down.weight, block.mlp.down.bias)


@torch.no_grad()
def center_unembed(model: nn.Module) -> None:
    """Subtract the mean logit direction: W_U -= mean over vocab, b_U -= mean(b_U)."""
    untie_unembedding(model)
    model.unembed.weight -= model.unembed.weight.mean(dim=0, keepdim=True)
    model.unembed_bias -= model.unembed_bias.mean()


@torch.no_grad()
def fold_value_biases(model: nn.Module) -> None:
    """b_O += sum over heads of W_O[h] @ b_V[kv(h)], then b_V = 0 (pattern rows sum to 1)."""
    for block in model.blocks:
        attn = block.attn
        if attn.qkv.bias is None:
            continue
        d_kv = attn.n_kv_heads * attn.d_head
        b_v = attn.qkv.bias[-d_kv:].view(attn.n_kv_heads, attn.d_head)
        b_v = b_v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=0)  # (heads, d_head)
        w_o = attn.out.weight.view(-1, attn.n_heads, attn.d_head)  # (d_model, heads, d_head)
        folded = torch.einsum("dhe,he->d", w_o, b_v)
        if attn.out.bias is None:
            attn.out.bias = nn.Parameter(folded)
        else:
            attn.out.bias += folded
        attn.qkv.bias[-d_kv:] = 0.0


def process_weights(model: nn.Module, fold: bool = True, center_writing: bool = True,
                    center_logits: bool = True, fold_values: bool = True) -> None:
    """TransformerLens's default processing; centring the writing weights only where every norm is a LayerNorm."""
    if fold:
        fold_ln(model)
    norms = [model.ln_final, *(n for b in model.blocks for n in (b.ln1, b.ln2) if n is not None)]
    if center_writing and all(_is_layernorm(norm) for norm in norms):
        center_writing_weights(model)
    if center_logits:
        center_unembed(model)
    if fold_values:
        fold_value_biases(model)

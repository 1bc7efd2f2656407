"""Weight processing, as TransformerLens does it on loading: four rewrites that leave log-probs unchanged.

* `fold_ln`: move each pre-norm's gain (and LayerNorm's bias) into the weights that read its output,
  and centre those reading weights (LayerNorm's output has zero mean, so their mean is never seen);
  the norms are left as the identity scaling (gain 1, or 0 where an RMSNorm scales by 1 + w, as
  Gemma's do). What cannot be folded forward is left exact, as TransformerLens leaves it: Gemma 3's
  post-norms (they normalise a sublayer's output, so nothing after them can absorb their divisor)
  and the per-head q/k norms.
* `center_writing_weights`: subtract the mean over d_model from everything written to the
  residual stream (embeddings, attention and MLP out projections and biases). Every reader is a
  LayerNorm, which subtracts the mean anyway. On an RMSNorm model it does nothing, as
  TransformerLens (an RMSNorm does not subtract the mean, so centring would change the outputs).
* `center_unembed`: subtract each unembedding row's mean over the vocabulary (softmax ignores a
  constant added to every logit).
* `fold_value_biases`: each attention pattern row sums to 1, so the value bias always adds
  b_V @ W_O; fold it into the out bias.

`process_weights(model)` applies all four (TransformerLens's defaults). Each edits the model in
place, under no_grad, computing in float32 at least. A tied unembedding is untied first (folding
changes it, not the embedding).

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

import warnings

import torch
from jaxtyping import Float
from torch import Tensor, nn

from glasslm.core.layers import LayerNorm, Linear, upcast


def _is_layernorm(norm: nn.Module | None) -> bool:
    return isinstance(norm, LayerNorm)


def norm_gain(norm: nn.Module) -> Float[Tensor, "d_model"]:
    """What the norm multiplies each feature by: its weight, or 1 + weight for Gemma's RMSNorm (unit_offset)."""
    weight = upcast(norm.weight.detach())
    return 1.0 + weight if getattr(norm, "unit_offset", False) else weight.clone()


def _make_identity(norm: nn.Module) -> None:
    """Gain 1 (a weight of 0 where the norm scales by 1 + weight), shift 0."""
    norm.weight.fill_(0.0 if getattr(norm, "unit_offset", False) else 1.0)
    if getattr(norm, "bias", None) is not None:
        norm.bias.zero_()


def _fold_norm_into(norm: nn.Module, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor | None]:
    """W' = W * gain (per input feature), b' = b + W @ norm_bias, reading weights centred for LayerNorm.

    `weights` are (d_out, d_model) reading the norm's output, edited in place; returns the new biases
    (a bias is created where the norm has a shift and the reader had none)."""
    if getattr(norm, "unbiased_std", False):
        raise ValueError("fold_ln does not support norm_unbiased_std LayerNorm")
    gain = norm_gain(norm)
    shift = getattr(norm, "bias", None)
    new_biases = []
    for weight, bias in zip(weights, biases):
        w32 = upcast(weight)
        if shift is not None:
            folded = w32 @ upcast(shift.detach())  # (d_out,)
            bias = folded.to(weight.dtype) if bias is None else bias.copy_(upcast(bias) + folded)
        w32 = w32 * gain
        if _is_layernorm(norm):
            w32 = w32 - w32.mean(dim=1, keepdim=True)
        weight.copy_(w32)
        new_biases.append(bias)
    _make_identity(norm)
    return new_biases


def _fold_into_linears(norm: nn.Module, readers: list[Linear]) -> None:
    for linear, bias in zip(readers, _fold_norm_into(norm, [r.weight for r in readers], [r.bias for r in readers])):
        if linear.bias is None and bias is not None:
            linear.bias = nn.Parameter(bias)


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
    """Fold every pre-norm's gain and bias into the next weights (ln1 -> q/k/v, ln2 -> MLP in and gate,
    ln_final -> unembed). Post-norms and q/k norms stay as they are (they cannot be folded forward)."""
    if model.config.norm_placement != "pre":
        raise ValueError("fold_ln needs a pre-norm model (norm_placement='pre')")
    for block in model.blocks:
        _fold_into_linears(block.ln1, [block.attn.qkv])
        if block.mlp is not None:
            _fold_into_linears(block.ln2, [block.mlp.up] + ([block.mlp.gate] if hasattr(block.mlp, "gate") else []))
    if model.ln_final is not None:
        untie_unembedding(model)
        (model.unembed_bias,) = _fold_norm_into(model.ln_final, [model.unembed.weight], [model.unembed_bias])


def _center(weight: Tensor, bias: Tensor | None) -> None:
    """Subtract the mean over the d_model output axis (dim 0 of a (d_model, d_in) weight)."""
    weight -= weight.mean(dim=0, keepdim=True)
    if bias is not None:
        bias -= bias.mean()


def _writing_centred_is_exact(model: nn.Module) -> bool:
    """Whether every reader of the stream subtracts its mean: True for pre-norm LayerNorm models, False
    for RMSNorm ones (nothing to do); anything else (post-norm, sandwich LayerNorms, no final norm) raises."""
    config = model.config
    if config.norm == "rmsnorm":
        return False
    norms = [model.ln_final, *(n for b in model.blocks for n in (b.ln1, b.ln2) if n is not None)]
    if config.norm_placement != "pre" or config.post_norms or not all(_is_layernorm(norm) for norm in norms):
        raise ValueError("center_writing_weights needs a pre-norm model whose every reader of the stream is a "
                         "LayerNorm (and a final norm); post-norms and a missing final norm read the stream's mean")
    return True


@torch.no_grad()
def center_writing_weights(model: nn.Module) -> None:
    """Make everything written to the residual stream mean-zero over d_model (pre-norm LayerNorm models).

    On an RMSNorm model it does nothing, as TransformerLens: an RMSNorm does not subtract the mean, so
    centring would change the outputs (it warns, so a direct call is not mistaken for a centring)."""
    if not _writing_centred_is_exact(model):
        warnings.warn("center_writing_weights does nothing on an RMSNorm model (as TransformerLens): "
                      "an RMSNorm reads the stream's mean", stacklevel=2)
        return
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
    """Subtract the mean logit direction: W_U -= mean over vocab, b_U -= mean(b_U). (Exact because softmax
    ignores a shift of every logit; a logit soft-cap does not, so a model with one is refused.)"""
    if getattr(getattr(model, "config", None), "logit_softcap", None) is not None:
        raise ValueError("center_unembed would change this model's predictions: its logits are soft-capped "
                         "(logit_softcap), and a cap does not ignore a shift as softmax does")
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
    """TransformerLens's default processing; centring the writing weights only where every norm is a LayerNorm
    (on RMSNorm models that step is skipped, as TransformerLens skips it), and the logits only where they
    are not soft-capped (Gemma 2; TransformerLens skips it there too)."""
    if fold:
        fold_ln(model)
    if center_writing and _writing_centred_is_exact(model):
        center_writing_weights(model)
    if center_logits and getattr(getattr(model, "config", None), "logit_softcap", None) is None:
        center_unembed(model)
    if fold_values:
        fold_value_biases(model)

"""The fast one-token decoding step: the model's own layers, with the small steps between its matrix
products done by glasslm's C++ kernels (`glasslm.kernels.decode`), one call each.

`TransformerLM.forward` is what a learner reads, and what hooks see. Decoding one token with it on a
CPU costs far more than its matrix products: SmolLM2-135M's step took 17 ms on one core of the AMD
EPYC here, of which its 151 quantized products took 7. The rest was ~40 tensor operators and a dozen
module calls per layer, each a few microseconds on a vector of 576 floats. This step runs the same
layers in the same order with the same weights: the same linear layers (quantized or not) and
activations are called, norms and the residual add before them are one call (`add_rms_norm`), and
rotary, the cache write and attention over the filled cache slots are one call (`decode_attention`).
Its logits equal the readable path's to float32 rounding (tests/generation/test_fast.py holds every
family to that, and greedy tokens to identity).

`DecodeWindow.decode` takes it whenever `FastDecoder.for_model` accepts the model (float32 activations,
the kernels built, pre-norm blocks without per-head q/k norms) and `usable()` says nothing would be
missed: no hook attached to any module, no TransformerLens-style split inputs or per-head results, eval
mode. Otherwise, and with `GLASSLM_KERNELS=off`, decoding runs the readable forward.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> fast = FastDecoder.for_model(model)
    >>> cache = model.new_kv_cache(1, 8)
    >>> with torch.inference_mode():
    ...     _ = model(torch.tensor([[1, 2]]), kv_cache=cache)
    ...     logits = fast.step(torch.tensor([3]), cache, torch.tensor([2])) if fast else None
    >>> fast is None or tuple(logits.shape)
    (1, 512)
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from glasslm.core.attention import KVCache
from glasslm.core.layers import RMSNorm, SwiGLU, _has_any_global_hook
from glasslm.core.model import Block, TransformerLM
from glasslm.kernels.decode import add_rms_norm, decode_attention, decode_ops, rms_norm


def unsupported(model: TransformerLM) -> str | None:
    """Why the fast step cannot run `model` (None: it can)."""
    c = model.config
    weight = getattr(model.embed, "weight", None)
    if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return "the fast step runs float32 activations on a CPU"
    if c.norm_placement != "pre" or c.qk_norm:
        return "post-norm blocks and per-head q/k norms run the readable step"
    for block in model.blocks:
        rotary = block.attn.rotary
        if rotary is not None and (rotary.dynamic is not None or rotary.cos.dtype != torch.float32):
            return "dynamic NTK rotary scaling runs the readable step"
    return None


class FastDecoder:
    """One-token decoding steps of `model` through the C++ step kernels (see the module docstring)."""

    def __init__(self, model: TransformerLM):
        self.model = model
        self.blocks: list[Block] = list(model.blocks)
        # Every hook any module could run (forward, pre-forward, backward), as the dicts nn.Module keeps
        # them in: registering a hook adds to one of these dicts, never replaces it.
        self._hook_tables = [table for module in model.modules() for table in (
            module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)]

    @classmethod
    def for_model(cls, model: TransformerLM) -> FastDecoder | None:
        """The fast step for `model`, or None where it cannot run it (no kernels, `unsupported`)."""
        if decode_ops() is None or unsupported(model) is not None:
            return None
        return cls(model)

    def usable(self) -> bool:
        """Whether a step now would compute exactly what the readable forward shows: no hook attached
        anywhere, no opt-in hook inputs or per-head results, eval mode. Checked every step."""
        if self.model.training or any(self._hook_tables) or _has_any_global_hook():
            return False
        return not any(b.use_attn_in or b.use_split_qkv_input or b.use_hook_mlp_in or b.attn.use_attn_result
                       for b in self.blocks)

    def step(self, tokens: Int[Tensor, "batch"], cache: KVCache, positions: Int[Tensor, "batch"],
             key_mask: Bool[Tensor, "batch slots"] | None = None) -> Float[Tensor, "batch vocab"]:
        """The next-token logits (float32) after one new token per row, written into the cache's next
        slot (the cursor advances); `positions` are the tokens' positions, `key_mask` which slots hold
        real tokens (None: all)."""
        model, c = self.model, self.model.config
        slot = cache.length
        if slot + 1 > c.context_length and c.positional != "none":
            raise ValueError(f"sequence of {slot + 1} tokens is longer than the context length {c.context_length}")
        model.check_tokens(tokens[:, None])
        x = model.embed(tokens[:, None])  # (batch, 1, d_model)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        if model.pos_embed is not None:
            x = x + model.pos_embed(positions[:, None])
        x = x.contiguous()
        pending = None  # an output still to be added to x, added by the next norm's call
        for layer, block in enumerate(self.blocks):
            x, pending = _block_step(block, x, pending, cache.keys[layer], cache.values[layer], slot, positions,
                                     key_mask)
        cache.advance(1)
        if pending is not None:
            x.add_(pending)
        return model.logits(x)[:, 0].float()


def _norm(norm: nn.Module, x: Float[Tensor, "batch 1 d"], pending: Tensor | None) -> Float[Tensor, "batch 1 d"]:
    """norm(x), after x += pending (in place) where an output is pending: one call for an RMSNorm."""
    if isinstance(norm, RMSNorm) and norm.weight.dtype == torch.float32:
        if pending is None:
            return rms_norm(x, norm.weight, norm.eps, norm.unit_offset)
        return add_rms_norm(x, pending, norm.weight, norm.eps, norm.unit_offset)
    if pending is not None:
        x.add_(pending)
    return norm(x)


def _attention(block: Block, h: Float[Tensor, "batch 1 d_model"], keys: Tensor, values: Tensor, slot: int,
               positions: Tensor, key_mask: Tensor | None) -> Float[Tensor, "batch 1 d_model"]:
    """The attention sublayer's output for one new token per row (its keys and values cached)."""
    attn = block.attn
    rotary = attn.rotary
    cos, sin = (None, None) if rotary is None else (rotary.cos, rotary.sin)
    batch = h.shape[0]
    z = decode_attention(attn.qkv(h).reshape(batch, -1).contiguous(), keys, values, slot, positions, cos, sin, attn.n_heads,
                         attn.n_kv_heads, attn.scale, key_mask, attn.sliding_window or 0)
    out = attn.out(z[:, None])  # (batch, 1, d_model)
    return out if block.ln1_post is None else block.ln1_post(out)


def _mlp(block: Block, h: Float[Tensor, "batch 1 d_model"]) -> Float[Tensor, "batch 1 d_model"]:
    """The MLP sublayer's output: the module's own layers and activation, without its hook points."""
    mlp = block.mlp
    if isinstance(mlp, SwiGLU):
        out = mlp.down(mlp.act(mlp.gate(h)) * mlp.up(h))
    else:
        out = mlp.down(mlp.act(mlp.up(h)))
    return out if block.ln2_post is None else block.ln2_post(out)


def _block_step(block: Block, x: Float[Tensor, "batch 1 d_model"], pending: Tensor | None, keys: Tensor,
                values: Tensor, slot: int, positions: Tensor,
                key_mask: Tensor | None) -> tuple[Float[Tensor, "batch 1 d_model"], Tensor | None]:
    """One block for one new token per row: the stream (with an earlier output added) and the output
    the stream still has to add (left pending so the next norm adds it in the same call)."""
    h = _norm(block.ln1, x, pending)
    attended = _attention(block, h, keys, values, slot, positions, key_mask)
    if block.parallel:  # GPT-NeoX: the MLP reads the same stream as attention; both outputs are added
        return x, attended if block.mlp is None else attended + _mlp(block, _norm(block.ln2, x, None))
    if block.mlp is None:
        return x, attended
    return x, _mlp(block, _norm(block.ln2, x, attended))


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
the kernels built, pre-norm blocks) and `usable()` says nothing would be
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
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from glasslm.core.attention import KVCache
from glasslm.core.layers import (
    FAST_ACTIVATIONS, READABLE_ACTIVATIONS, LayerNorm, RMSNorm, SwiGLU, _has_any_global_hook, linear, softcap,
)
from glasslm.core.model import Block, TransformerLM
from glasslm.core.moe import MoE, route
from glasslm.kernels.decode import (
    add_layer_norm, add_rms_norm, decode_attention, decode_ops, layer_norm, rms_norm,
)
from glasslm.kernels.experts import native_experts
from glasslm.transforms.split import RowSplitLinear


def unsupported(model: TransformerLM) -> str | None:
    """Why the fast step cannot run `model` (None: it can)."""
    c = model.config
    if model.embed.dtype != torch.float32 or model.embed.device.type != "cpu":
        return "the fast step runs float32 activations on a CPU"
    if c.norm_placement != "pre":
        return "post-norm blocks run the readable step"
    if c.n_experts and any(not isinstance(block.mlp, (MoE, SwiGLU)) for block in model.blocks):
        return "adapters on a mixture of experts' experts run the readable step"
    for block in model.blocks:
        rotary = block.attn.rotary
        if rotary is not None and (rotary.dynamic is not None or rotary.cos.dtype != torch.float32):
            return "dynamic NTK rotary scaling runs the readable step"
        if block.attn.cap is not None:  # (decode_attention has no cap: kernels/decode.cpp)
            return "soft-capped attention scores (Gemma 2) run the readable step"
    return None


class FastDecoder:
    """One-token decoding steps of `model` through the C++ step kernels (see the module docstring)."""

    def __init__(self, model: TransformerLM, native_blocks: bool = True):
        self.model = model
        self.blocks: list[Block] = list(model.blocks)
        self.attentions = [block.attn for block in self.blocks]
        self.layers = [_Layer.of(block) for block in self.blocks]
        # Each block's step: one C++ call where every product in it is a packed quantized matrix
        # (kernels/block.cpp), else the layer's Python step over the same kernels.
        natives = [native_block(layer) if native_blocks else None for layer in self.layers]
        self.steps = [layer.step if native is None else native.step for layer, native in zip(self.layers, natives)]
        # All of them in one call where every block is native (a custom class's call costs ~6 µs).
        self.native_stack = native_stack(natives)
        self.final_norm = _Norm.of(model.ln_final)
        # Every hook any module could run (forward, pre-forward, backward), as the dicts nn.Module keeps
        # them in: registering a hook adds to one of these dicts, never replaces it.
        self._hook_tables = [table for module in model.modules() for table in (
            module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)]
        self._no_hooks_at = -1  # RemovableHandle.next_id when the tables were last found empty

    @classmethod
    def for_model(cls, model: TransformerLM) -> FastDecoder | None:
        """The fast step for `model`, or None where it cannot run it (no kernels, `unsupported`)."""
        if decode_ops() is None or unsupported(model) is not None:
            return None
        return cls(model)

    def usable(self) -> bool:
        """Whether a step now would compute exactly what the readable forward shows: no hook attached
        anywhere, no opt-in hook inputs or per-head results, eval mode. Checked every step."""
        if self.model.training or _has_any_global_hook() or not self._no_hooks():
            return False
        return not (any(b.use_attn_in or b.use_split_qkv_input or b.use_hook_mlp_in for b in self.blocks)
                    or any(a.use_attn_result for a in self.attentions))

    def _no_hooks(self) -> bool:
        """No module of the model has a hook. Reading every module's tables takes ~100 µs (SmolLM2 has
        1,151 modules), so a finding of none is kept until torch hands out another hook handle (every
        `register_*hook` call makes one, numbered by `RemovableHandle.next_id`)."""
        stamp = RemovableHandle.next_id
        if stamp != self._no_hooks_at:
            if any(self._hook_tables):
                return False  # looked at again next step: a hook removed leaves the stamp unchanged
            self._no_hooks_at = stamp
        return True

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
        if self.native_stack is not None:
            x, pending = self.native_stack.step(x, cache.keys, cache.values, slot, positions, key_mask)
        else:
            pending = None  # an output still to be added to x, added by the next norm's call
            for step, keys, values in zip(self.steps, cache.keys, cache.values):
                x, pending = step(x, pending, keys, values, slot, positions, key_mask)
        cache.advance(1)
        return self._logits(x, pending)[:, 0].float()

    def _logits(self, x: Float[Tensor, "batch 1 d_model"], pending: Tensor | None) -> Float[Tensor, "batch 1 vocab"]:
        """`TransformerLM.logits` of x + pending, the add and the final norm in one call."""
        model = self.model
        if self.final_norm is not None:
            x = self.final_norm(x, pending)
        elif pending is not None:
            x = x.add_(pending)
        logits = linear(x, model.embed.weight) if model.unembed is None else model.unembed(x)
        if model.unembed_bias is not None:
            logits = logits + model.unembed_bias
        cap = model.config.logit_softcap
        return logits if cap is None else softcap(logits, cap, "fast")  # (as TransformerLM.logits: Gemma 2)


@dataclass
class _Norm:
    """A norm as the step calls it: a float32 RMSNorm's or LayerNorm's operands for the C++ call, or the
    module itself."""

    module: nn.Module
    weight: Tensor | None  # float32 gain (None: call the module)
    bias: Tensor | None = None  # LayerNorm's shift
    eps: float = 0.0
    unit_offset: bool = False

    @classmethod
    def of(cls, norm: nn.Module | None) -> _Norm | None:
        if norm is None:
            return None
        if isinstance(norm, RMSNorm) and norm.weight.dtype == torch.float32:
            return cls(norm, norm.weight, None, norm.eps, norm.unit_offset)
        if isinstance(norm, LayerNorm) and norm.weight.dtype == torch.float32 and not norm.unbiased_std:
            return cls(norm, norm.weight, norm.bias, norm.eps)
        return cls(norm, None)

    def __call__(self, x: Float[Tensor, "batch 1 d"], pending: Tensor | None = None) -> Float[Tensor, "batch 1 d"]:
        """norm(x), after x += pending (in place) where an output is pending: one C++ call for a float32
        RMSNorm or LayerNorm."""
        if self.weight is None:
            if pending is not None:
                x.add_(pending)
            return self.module(x)
        if isinstance(self.module, LayerNorm):
            if pending is None:
                return layer_norm(x, self.weight, self.bias, self.eps)
            return add_layer_norm(x, pending, self.weight, self.bias, self.eps)
        if pending is None:
            return rms_norm(x, self.weight, self.eps, self.unit_offset)
        return add_rms_norm(x, pending, self.weight, self.eps, self.unit_offset)


@dataclass
class _Layer:
    """One block's modules and constants, looked up once per window (nn.Module attribute lookups
    cost ~1 µs each, and a step would make ~15 per layer)."""

    ln1: _Norm
    qkv: nn.Module
    out: nn.Module
    cos: Tensor | None
    sin: Tensor | None
    heads: int
    kv_heads: int
    scale: float
    window: int
    ln1_post: _Norm | None
    parallel: bool
    ln2: _Norm | None
    gate: nn.Module | None  # SwiGLU's gate (None: a plain MLP, or no MLP)
    up: nn.Module | None
    down: nn.Module | None
    act: Callable[[Tensor], Tensor] | None
    ln2_post: _Norm | None
    q_norm: _Norm | None  # per-head norms of the queries and keys over d_head (Qwen3, Gemma 3), before rotary
    k_norm: _Norm | None
    moe: _Experts | None = None  # a mixture of experts in place of the MLP (gate, up, down, act None)
    qk_whole: bool = False  # the q/k norms span all heads' features at once (OLMoE), not each head's

    @classmethod
    def of(cls, block: Block) -> _Layer:
        attn, rotary = block.attn, block.attn.rotary
        moe = _Experts.of(block.mlp) if isinstance(block.mlp, MoE) else None
        mlp = None if moe is not None else block.mlp
        return cls(_Norm.of(block.ln1), attn.qkv, attn.out, None if rotary is None else rotary.cos,
                   None if rotary is None else rotary.sin, attn.n_heads, attn.n_kv_heads, attn.scale,
                   attn.sliding_window or 0, _Norm.of(block.ln1_post), block.parallel, _Norm.of(block.ln2),
                   mlp.gate if isinstance(mlp, SwiGLU) else None, None if mlp is None else mlp.up,
                   None if mlp is None else mlp.down, None if mlp is None else mlp.act, _Norm.of(block.ln2_post),
                   _Norm.of(attn.q_norm), _Norm.of(attn.k_norm), moe, attn.qk_norm_whole)

    def attention(self, h: Float[Tensor, "batch 1 d_model"], keys: Tensor, values: Tensor, slot: int,
                  positions: Tensor, key_mask: Tensor | None) -> Float[Tensor, "batch 1 d_model"]:
        """The attention sublayer's output for one new token per row (its keys and values cached)."""
        qkv = self.qkv(h).reshape(h.shape[0], -1).contiguous()  # (batch, (heads + 2 kv_heads) d_head)
        if self.q_norm is not None:
            qkv = self.normed_queries_and_keys(qkv)
        z = decode_attention(qkv, keys, values, slot, positions, self.cos, self.sin, self.heads, self.kv_heads,
                             self.scale, key_mask, self.window)
        out = self.out(z[:, None])  # (batch, 1, d_model)
        return out if self.ln1_post is None else self.ln1_post(out)

    def normed_queries_and_keys(self, qkv: Float[Tensor, "batch width"]) -> Float[Tensor, "batch width"]:
        """q|k|v with each query head and key head normed over its d_head features (values unchanged)."""
        batch, kv_start = qkv.shape[0], self.heads + self.kv_heads
        if self.qk_whole:  # OLMoE: one norm over all query heads' features, one over all key heads'
            d_head = qkv.shape[1] // (kv_start + self.kv_heads)
            q_end, k_end = self.heads * d_head, kv_start * d_head
            q, k = self.q_norm(qkv[:, :q_end].contiguous()), self.k_norm(qkv[:, q_end:k_end].contiguous())
            return torch.cat([q, k, qkv[:, k_end:]], dim=1)
        heads = qkv.view(batch, kv_start + self.kv_heads, -1)  # (batch, heads + 2 kv_heads, d_head)
        q = self.q_norm(heads[:, :self.heads].contiguous())
        k = self.k_norm(heads[:, self.heads:kv_start].contiguous())
        return torch.cat([q, k, heads[:, kv_start:]], dim=1).reshape(batch, -1)

    def mlp(self, h: Float[Tensor, "batch 1 d_model"]) -> Float[Tensor, "batch 1 d_model"]:
        """The MLP sublayer's output: the module's own layers and activation, without its hook points."""
        if self.moe is not None:
            out = self.moe(h)
        elif self.gate is not None:
            out = self.down(self.act(self.gate(h)) * self.up(h))
        else:
            out = self.down(self.act(self.up(h)))
        return out if self.ln2_post is None else self.ln2_post(out)

    def step(self, x: Float[Tensor, "batch 1 d_model"], pending: Tensor | None, keys: Tensor, values: Tensor,
             slot: int, positions: Tensor, key_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The block for one new token per row: the stream (with an earlier output added) and the output
        it still has to add (left pending so the next norm adds it in the same call)."""
        attended = self.attention(self.ln1(x, pending), keys, values, slot, positions, key_mask)
        if self.parallel:  # GPT-NeoX: the MLP reads the same stream as attention; both outputs are added
            return x, attended if self.down is None else attended + self.mlp(self.ln2(x))
        if self.down is None and self.moe is None:
            return x, attended
        return x, self.mlp(self.ln2(x, attended))


@dataclass
class _Experts:
    """A mixture of experts' decoding step: the model's router and `route` (core/moe.py) pick each row's
    experts, then only those experts run: in one C++ call (kernels/experts.cpp) where every expert's
    three matrices are packed (a GGUF file's blocks: transforms/experts.py), else through the module's
    own grouped path. The shared expert (Qwen2-MoE) is the module's own layers."""

    module: MoE
    native: Any | None

    @classmethod
    def of(cls, moe: MoE) -> _Experts:
        views = [getattr(getattr(moe, name), "expert_matrices", lambda: None)() for name in ("gate", "up", "down")]
        native = None
        if all(v is not None for v in views) and moe.act in _SILU:  # (experts.cpp's SwiGLU is SiLU's)
            native = native_experts(*views)
        return cls(moe, native)

    def __call__(self, h: Float[Tensor, "batch 1 d_model"]) -> Float[Tensor, "batch 1 d_model"]:
        moe = self.module
        flat = h.reshape(-1, h.shape[-1])  # (batch, d_model)
        weights, experts = route(moe.router(flat), moe.k, moe.renormalize)  # (batch, k) each
        if self.native is not None:
            out = self.native(flat, experts, weights)
        else:
            out = moe.experts_grouped(flat, weights.to(flat.dtype), experts)
        out = out.reshape(h.shape)
        if moe.shared is not None:  # (SwiGLU takes (batch, seq, d_model))
            out = out + torch.sigmoid(moe.shared_gate(h)) * moe.shared(h)
        return out


_SILU = {READABLE_ACTIVATIONS["silu"], FAST_ACTIVATIONS["silu"]}

# kernels/block.cpp's numbering of a Block's norms, products and activations.
_NORM_KINDS = {RMSNorm: 1, LayerNorm: 2}
_ACTIVATIONS = {table[name]: code for code, name in enumerate(("gelu", "gelu_tanh", "relu", "silu"))
                for table in (READABLE_ACTIVATIONS, FAST_ACTIVATIONS)}


def native_block(layer: _Layer) -> Any | None:
    """`layer` as a C++ `glasslm_kernels.Block` (kernels/block.cpp) whose `step` is `layer.step` in one
    call, or None where a part of it has no C++ form there: a product that is not a packed quantized
    matrix or a row split of them (float weights, adapters), a norm other than a float32 RMSNorm or
    LayerNorm, another activation."""
    if layer.moe is not None or layer.qk_whole:  # (block.cpp has neither: the Python step, experts in C++)
        return None
    native = torch.classes.glasslm_kernels.Block()
    for slot, module in enumerate((layer.qkv, layer.out, layer.gate, layer.up, layer.down)):
        # A row split (a mixed GGUF file's q|k and v) is one product of several matrices side by side.
        for part in () if module is None else module.parts if isinstance(module, RowSplitLinear) else (module,):
            matrix = getattr(part, "kernel_matrix", lambda: None)()
            if matrix is None:
                return None
            native.add_matrix(slot, *matrix.operands(), part.bias)
    for slot, norm in enumerate((layer.ln1, layer.ln1_post, layer.ln2, layer.ln2_post, layer.q_norm, layer.k_norm)):
        if norm is None:
            continue
        module = norm.module
        kind = _NORM_KINDS.get(type(module))
        if kind is None or module.weight.dtype != torch.float32 or getattr(module, "unbiased_std", False):
            return None
        native.set_norm(slot, kind, module.weight, getattr(module, "bias", None), module.eps,
                        getattr(module, "unit_offset", False))
    if layer.down is not None and layer.act not in _ACTIVATIONS:
        return None
    native.set_attention(layer.cos, layer.sin, layer.heads, layer.kv_heads, layer.scale, layer.window)
    native.set_mlp(_ACTIVATIONS.get(layer.act, 0), layer.parallel)
    return native


def native_stack(natives: list[Any | None]) -> Any | None:
    """The blocks as one C++ `glasslm_kernels.Stack` whose `step` runs each Block's in turn, or None
    unless every block has a native form."""
    if not natives or any(native is None for native in natives):
        return None
    stack = torch.classes.glasslm_kernels.Stack()
    for native in natives:
        stack.add(native)
    return stack

"""Causal multi-head self-attention, written out step by step, with a fused fast path and a KV cache.

Example:
    >>> import torch
    >>> softmax(torch.tensor([1e30, 0.0]), dim=-1)  # stays finite for huge logits
    tensor([1., 0.])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from glasslm.core.layers import HookPoint, Linear, dropout, softcap, upcast
from glasslm.core.positions import RotaryPositions


def softmax(x: Float[Tensor, "..."], dim: int = -1) -> Float[Tensor, "..."]:
    """exp(x) / sum(exp(x)), computed after subtracting the max so exp never overflows.

    A row that is entirely -inf (every key masked out) gives zeros rather than NaN.
    """
    row_max = x.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exps = torch.exp(x - row_max)
    return exps / exps.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(exps.dtype).tiny)


def causal_mask(n_queries: int, n_keys: int, device: torch.device | None = None) -> Bool[Tensor, "q k"]:
    """True where a query may attend: the last n_queries slots of n_keys see themselves and the past."""
    offset = n_keys - n_queries
    q = torch.arange(n_queries, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    return k <= q + offset


def sliding_window_mask(n_queries: int, n_keys: int, window: int, device: torch.device | None = None) -> Bool[Tensor, "q k"]:
    """Causal, and each query sees only its last `window` keys (itself included), as in Mistral.

    Example:
        >>> sliding_window_mask(3, 3, 2).int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    offset = n_keys - n_queries
    q = torch.arange(n_queries, device=device)[:, None] + offset  # each query's position among the keys
    k = torch.arange(n_keys, device=device)[None, :]
    return (k <= q) & (k > q - window)


def scaled_dot_product_attention(
    q: Float[Tensor, "batch heads q_seq d_head"],
    k: Float[Tensor, "batch heads k_seq d_head"],
    v: Float[Tensor, "batch heads k_seq d_head"],
    mask: Bool[Tensor, "... q_seq k_seq"] | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    scores_hook: HookPoint | None = None,
    pattern_hook: HookPoint | None = None,
    scale: float | None = None,
    cap: float | None = None,
) -> Float[Tensor, "batch heads q_seq d_head"]:
    """softmax(q k^T * scale, masked) v — the readable reference for the fused kernel.

    `scale` defaults to 1/sqrt(d_head); some models divide by sqrt(d_model) instead. With `cap`, the
    scores are soft-capped, cap * tanh(scores / cap), before the mask (Gemma 2).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale  # (batch, heads, q_seq, k_seq)
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)  # within (-cap, cap), nearly unchanged where small
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if scores_hook is not None:
        scores = scores_hook(scores)
    # Softmax in at least float32: bf16/fp16 exponentials lose too much precision.
    pattern = softmax(upcast(scores), dim=-1).to(q.dtype)
    if pattern_hook is not None:
        pattern = pattern_hook(pattern)
    pattern = dropout(pattern, dropout_p, training)
    return pattern @ v


def softcapped_attention(
    q: Float[Tensor, "batch heads q_seq d_head"], k: Float[Tensor, "batch kv_heads k_seq d_head"],
    v: Float[Tensor, "batch kv_heads k_seq d_head"], mask: Bool[Tensor, "... q_seq k_seq"] | None, scale: float,
    cap: float, dropout_p: float = 0.0, training: bool = False,
) -> Float[Tensor, "batch heads q_seq d_head"]:
    """`scaled_dot_product_attention` with soft-capped scores, the fast way (PyTorch's fused kernel has
    no cap): the query heads that share a key/value head are one batch of rows against it, so keys and
    values are never repeated per head, and in inference the cap is computed in place.

    >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    >>> mask = causal_mask(3, 3)
    >>> reference = scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask,
    ...                                          scale=0.3, cap=5.0)
    >>> torch.allclose(softcapped_attention(q, k, v, mask, 0.3, 5.0), reference, atol=1e-6)
    True
    """
    batch, heads, q_seq, d_head = q.shape
    kv_heads, k_seq = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    rows = q.reshape(batch, kv_heads, groups * q_seq, d_head)  # each kv head's query heads, one after another
    scores = (rows @ k.transpose(-2, -1)).mul_(scale).view(batch, kv_heads, groups, q_seq, k_seq)
    scores = softcap(scores, cap, "fast")
    if mask is not None:  # (q_seq, k_seq), or (batch, 1, q_seq, k_seq) with a group axis added
        scores = scores.masked_fill(~(mask.unsqueeze(2) if mask.dim() == 4 else mask), float("-inf"))
    pattern = dropout(softmax(upcast(scores), dim=-1).to(q.dtype), dropout_p, training)
    out = pattern.view(batch, kv_heads, groups * q_seq, k_seq) @ v  # (batch, kv_heads, groups q_seq, d_head)
    return out.view(batch, heads, q_seq, d_head)


class KVCache:
    """Per-layer key/value buffers, preallocated to max_length and filled in place.

    `length` counts the slots already written; a forward pass writes its keys and values at
    [length, length + seq) in every layer, then `advance(seq)` moves the cursor.

    Example:
        >>> cache = KVCache(n_layers=1, batch=1, n_kv_heads=2, max_length=8, d_head=4)
        >>> cache.length
        0
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_length: int, d_head: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        shape = (batch, n_kv_heads, max_length, d_head)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_length = max_length
        self.length = 0

    def update(
        self, layer: int, k: Float[Tensor, "batch kv_heads seq d_head"], v: Float[Tensor, "batch kv_heads seq d_head"]
    ) -> tuple[Float[Tensor, "batch kv_heads total d_head"], Float[Tensor, "batch kv_heads total d_head"]]:
        end = self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"KV cache is full: {end} slots needed, {self.max_length} allocated")
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0


class StaticKVCache(KVCache):
    """The same per-layer buffers, addressed by a position tensor instead of a Python cursor.

    `update_at` writes keys and values at the slots `positions` names (`index_copy_`) and returns the
    whole buffers, so every decoding step has the same shapes and no Python number that changes per
    step: a compiled decoder (`torch.compile`, as gpt-fast and litgpt do it) is traced once and
    reused. Attention then spans all max_length slots, masked to the slots at or before each query's
    position, which costs a little more per step than the growing view `KVCache` returns.

    Example:
        >>> cache = StaticKVCache(n_layers=1, batch=1, n_kv_heads=2, max_length=8, d_head=4)
        >>> k, v = cache.update_at(0, torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), torch.arange(3))
        >>> k.shape, int(k.sum())
        (torch.Size([1, 2, 8, 4]), 24)
    """

    def update_at(
        self, layer: int, k: Float[Tensor, "batch kv_heads seq d_head"], v: Float[Tensor, "batch kv_heads seq d_head"],
        positions: Int[Tensor, "seq"],
    ) -> tuple[Float[Tensor, "batch kv_heads max_length d_head"], Float[Tensor, "batch kv_heads max_length d_head"]]:
        self.keys[layer].index_copy_(2, positions, k.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(2, positions, v.to(self.values[layer].dtype))
        return self.keys[layer], self.values[layer]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask and optional grouped-query heads.

    Queries have n_heads heads; keys and values have n_kv_heads, each shared by
    n_heads / n_kv_heads query heads (n_kv_heads == n_heads is ordinary multi-head attention).
    `d_head` defaults to d_model / n_heads; `qkv_bias` (default: `bias`) switches the q/k/v
    biases apart from the output's (Qwen2 has the first, not the second); `sliding_window` limits
    each query to its last that-many keys (Mistral). `scale` multiplies the scores (default
    1/sqrt(d_head)); `dropout_p` applies to the attention probabilities. `q_norm` and `k_norm`
    (Qwen3, Gemma 3) normalise each head's queries and keys over d_head before the rotary;
    with `qk_norm_whole` (OLMoE) they normalise all heads' features at once (n_heads * d_head wide).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, bias: bool, dropout_p: float,
                 impl: str, rotary: RotaryPositions | None = None, *, d_head: int | None = None,
                 qkv_bias: bool | None = None, sliding_window: int | None = None, scale: float | None = None,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, cap: float | None = None,
                 qk_norm_whole: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_head or d_model // n_heads
        self.dropout_p, self.impl, self.sliding_window = dropout_p, impl, sliding_window
        self.scale = 1.0 / math.sqrt(self.d_head) if scale is None else scale
        self.cap = cap  # soft cap of the attention scores (Gemma 2); None: none
        # One projection makes q, k and v together: one matmul instead of three.
        self.qkv = Linear(d_model, (n_heads + 2 * n_kv_heads) * self.d_head, bias=bias if qkv_bias is None else qkv_bias)
        self.out = Linear(n_heads * self.d_head, d_model, bias=bias)
        self.rotary = rotary
        self.q_norm, self.k_norm, self.qk_norm_whole = q_norm, k_norm, qk_norm_whole
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_q_normed, self.hook_k_normed = HookPoint(), HookPoint()  # after q_norm / k_norm (batch, heads, seq, d_head)
        self.hook_attn_scores, self.hook_pattern, self.hook_z = HookPoint(), HookPoint(), HookPoint()
        # Queries and keys after rotary (fired only when hooked: the rotation itself is unchanged).
        self.hook_rot_q, self.hook_rot_k = HookPoint(), HookPoint()
        # Opt-in like TransformerLens's use_attn_result: each head's own d_model output passes through
        # hook_result (batch, seq, heads, d_model), at the cost of a (heads x d_model) wider product.
        self.use_attn_result = False
        self.hook_result = HookPoint()

    def forward(
        self,
        x: Float[Tensor, "batch seq d_model"] | tuple[Tensor, Tensor, Tensor],
        positions: Int[Tensor, "seq"] | Int[Tensor, "batch seq"],
        kv_cache: KVCache | None = None,
        layer: int = 0,
        attn_mask: Bool[Tensor, "batch q_seq k_seq"] | None = None,
    ) -> Float[Tensor, "batch seq d_model"]:
        """`x` is the normalised stream, or (q_in, k_in, v_in) per-head inputs (batch, seq, heads, d_model)."""
        stream = x[0] if isinstance(x, tuple) else x
        batch, seq = stream.shape[:2]
        q, k, v = self._heads(x, positions)  # (batch, heads or kv_heads, seq, d_head)
        static = isinstance(kv_cache, StaticKVCache)
        if static:
            if positions.dim() != 1 or attn_mask is not None:
                raise ValueError("a StaticKVCache takes one (seq,) positions tensor for every row, and no attn_mask")
            k, v = kv_cache.update_at(layer, k, v, positions)  # (batch, kv_heads, max_length, d_head)
            q = q.to(k.dtype)
        elif kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (batch, kv_heads, cached + seq, d_head)
            # A cache kept in a wider dtype than the activations (float32 for bf16 weights on CPU,
            # where bf16 attention kernels are slow) sets the dtype attention is computed in.
            q = q.to(k.dtype)
        if static:
            mask = self._static_mask(positions, k.shape[2], stream.device)
        else:
            mask = self._mask(seq, k.shape[2], kv_cache is not None, attn_mask, stream.device)
        # In a compiled one-token step the compiler fuses the math path's few small operators into
        # its own loops; the fused kernel would stay one opaque call (~90 µs at GPT-2's width, 136 slots).
        fused = not (static and seq == 1 and torch.compiler.is_compiling())
        z = self._attend(q, k, v, mask, plain_causal=mask is None and k.shape[2] == seq and seq > 1, fused=fused)
        z = self.hook_z(z.transpose(1, 2).to(stream.dtype))  # (batch, seq, heads, d_head)
        if self.use_attn_result:
            return self._per_head_result(z)
        return self.out(z.reshape(batch, seq, self.n_heads * self.d_head))

    def _per_head_result(self, z: Float[Tensor, "batch seq heads d_head"]) -> Float[Tensor, "batch seq d_model"]:
        """The out projection split by head: hook_result (batch, seq, heads, d_model), summed, plus the bias."""
        w_o = self.out.weight.view(-1, self.n_heads, self.d_head)  # (d_model, heads, d_head)
        result = self.hook_result(torch.einsum("bshe,dhe->bshd", z, w_o))
        out = result.sum(dim=2)
        return out if self.out.bias is None else out + self.out.bias

    def _projections(self, x: Tensor | tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """q (batch, seq, n_heads, d_head), k and v (batch, seq, n_kv_heads, d_head), before rotary."""
        d_q, d_kv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        if not isinstance(x, tuple):
            batch, seq, _ = x.shape
            q, k, v = self.qkv(x).split([d_q, d_kv, d_kv], dim=-1)  # (batch, seq, features) each
            return (q.view(batch, seq, self.n_heads, self.d_head), k.view(batch, seq, self.n_kv_heads, self.d_head),
                    v.view(batch, seq, self.n_kv_heads, self.d_head))
        # Split inputs: each head projects its own copy of the stream, (batch, seq, heads, d_model).
        weights = self.qkv.weight.split([d_q, d_kv, d_kv], dim=0)
        biases = self.qkv.bias.split([d_q, d_kv, d_kv]) if self.qkv.bias is not None else (None,) * 3
        out = []
        for inputs, weight, bias in zip(x, weights, biases):
            heads = weight.view(-1, self.d_head, weight.shape[-1])  # (heads, d_head, d_model)
            projected = torch.einsum("bshd,hed->bshe", inputs, heads)
            out.append(projected if bias is None else projected + bias.view(-1, self.d_head))
        return out[0], out[1], out[2]

    def _heads(self, x: Tensor | tuple[Tensor, Tensor, Tensor], positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (batch, n_heads, seq, d_head), k and v (batch, n_kv_heads, seq, d_head), rotated if rotary."""
        q, k, v = self._projections(x)  # (batch, seq, heads, d_head)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if self.q_norm is not None and self.qk_norm_whole:  # OLMoE: over (heads x d_head) at once
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        # Heads become a batch axis: (batch, heads, seq, d_head).
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.q_norm is not None and self.qk_norm_whole:
            q, k = self.hook_q_normed(q), self.hook_k_normed(k)
        elif self.q_norm is not None:  # per head over d_head; their hooks see (batch, heads, seq, ·), as TransformerLens's
            q, k = self.hook_q_normed(self.q_norm(q)), self.hook_k_normed(self.k_norm(k))
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
            if self.hook_rot_q.active or self.hook_rot_k.active:  # shown as (batch, seq, heads, d_head)
                q = self.hook_rot_q(q.transpose(1, 2)).transpose(1, 2)
                k = self.hook_rot_k(k.transpose(1, 2)).transpose(1, 2)
        return q, k, v

    def _static_mask(self, positions: Int[Tensor, "seq"], n_slots: int,
                     device: torch.device) -> Bool[Tensor, "seq max_length"]:
        """Slot j holds position j: a query at position p sees slots 0..p (later slots are stale or empty)."""
        slots = torch.arange(n_slots, device=device)
        mask = slots[None, :] <= positions[:, None]  # (seq, max_length)
        if self.sliding_window is not None:
            mask = mask & (slots[None, :] > positions[:, None] - self.sliding_window)
        return mask

    def _mask(self, seq: int, n_keys: int, cached: bool, attn_mask: Tensor | None,
              device: torch.device) -> Bool[Tensor, "... q_seq k_seq"] | None:
        """The mask for `seq` queries over `n_keys` keys, or None where plain causal (or no) masking does."""
        mask = None
        if attn_mask is not None:
            mask = attn_mask[:, None]  # (batch, 1, q_seq, k_seq): same mask for every head
        elif cached and seq > 1 and n_keys > seq:
            mask = causal_mask(seq, n_keys, device=device)
        # Otherwise the mask is plain causal (no cache, or prefill into an empty cache), or not
        # needed at all (one new query may see every cached key).
        if self.sliding_window is not None and n_keys > self.sliding_window:
            window = sliding_window_mask(seq, n_keys, self.sliding_window, device=device)
            mask = window if mask is None else mask & window
        return mask

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                plain_causal: bool, fused: bool = True) -> Float[Tensor, "batch heads q_seq d_head"]:
        """The fused kernel, or the readable path when asked for, when a hook needs the pattern, or `not fused`."""
        p = self.dropout_p if self.training else 0.0
        needs_pattern = self.hook_attn_scores.active or self.hook_pattern.active
        if self.impl == "fast" and fused and not needs_pattern and self.cap is not None:
            if plain_causal:
                mask = causal_mask(q.shape[2], k.shape[2], device=q.device)
            return softcapped_attention(q, k, v, mask, self.scale, self.cap, p, self.training)
        if self.impl == "fast" and fused and not needs_pattern:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=plain_causal,
                enable_gqa=self.n_kv_heads != self.n_heads, scale=self.scale,
            )
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:  # each kv head serves `groups` consecutive query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if plain_causal:
            mask = causal_mask(q.shape[2], q.shape[2], device=q.device)
        return scaled_dot_product_attention(
            q, k, v, mask, p, self.training, self.hook_attn_scores, self.hook_pattern, self.scale, self.cap
        )

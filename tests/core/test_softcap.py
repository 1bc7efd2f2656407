"""Gemma 2's soft-capping (ModelConfig.attn_softcap, logit_softcap): attention scores and logits
squashed to cap * tanh(x / cap). The readable path and the fast path (grouped heads without repeated
keys, the cap in place) against a reference written here from PyTorch ops, forward and backward, with
grouped heads, sliding windows, padding masks and both KV caches."""

from __future__ import annotations

import copy

import pytest
import torch

from glasslm.core.attention import softcapped_attention
from glasslm.core.config import ModelConfig
from glasslm.core.layers import softcap
from glasslm.core.model import TransformerLM
from tests.core.test_family_options import GEMMA_LIKE, perturbed

CAPPED = dict(GEMMA_LIKE, qk_norm=False, rope_local_theta=None, global_layers=(1,), attn_softcap=0.7,
              logit_softcap=2.5)


def reference_attention(q, k, v, scale, cap, window=None):
    """softmax(cap tanh(q k^T scale / cap), causal (and windowed)) v, each kv head repeated for its
    query heads: the maths as written, in float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    scores = cap * torch.tanh(scores / cap)
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (j > i - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v.double())


def test_softcap_is_cap_tanh_x_over_cap_both_ways():
    x = torch.randn(3, 7) * 20
    expected = 4.0 * torch.tanh(x / 4.0)
    torch.testing.assert_close(softcap(x.clone(), 4.0, "readable"), expected)
    torch.testing.assert_close(softcap(x.clone(), 4.0, "fast"), expected)
    assert softcap(x, 4.0).abs().max() <= 4.0 and torch.allclose(softcap(x * 1e-4, 4.0), x * 1e-4, rtol=1e-6)
    leaf = x.clone().requires_grad_()
    softcap(leaf, 4.0, "fast").sum().backward()  # a tensor autograd needs is never written in place
    torch.testing.assert_close(leaf.grad, 1 - torch.tanh(x / 4.0) ** 2)


@pytest.mark.parametrize("window", [None, 3])
def test_the_fast_capped_attention_is_the_written_out_maths(window):
    from glasslm.core.attention import causal_mask, sliding_window_mask

    q, k, v = torch.randn(2, 6, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    q, k = q * 3, k * 3  # scores well past the cap: the cap matters
    mask = causal_mask(7, 7) if window is None else sliding_window_mask(7, 7, window)
    expected = reference_attention(q, k, v, 0.4, 1.5, window)
    torch.testing.assert_close(softcapped_attention(q, k, v, mask, 0.4, 1.5).double(), expected, rtol=0, atol=1e-5)
    uncapped = reference_attention(q, k, v, 0.4, 1e9, window)
    assert (uncapped - expected).abs().max() > 0.1  # (else the test would not see a missing cap)


@torch.no_grad()
def test_a_capped_model_is_the_reference_in_both_paths_and_with_caches():
    model = perturbed(TransformerLM(ModelConfig(**CAPPED)))
    tokens = torch.randint(0, 53, (2, 12), generator=torch.Generator().manual_seed(0))
    readable = copy.deepcopy(model)
    for module in readable.modules():
        if hasattr(module, "impl"):
            module.impl = "readable"
    readable.config.impl = "readable"
    fast_logits, readable_logits = model(tokens), readable(tokens)
    torch.testing.assert_close(fast_logits, readable_logits, rtol=0, atol=2e-5)
    assert fast_logits.abs().max() < 2.5 and fast_logits.abs().max() > 2.0  # capped logits, near the cap
    # Each block's attention against the written-out maths, on the block's own q, k, v.
    block = model.blocks[0]
    x = block.ln1(model.embed(tokens) * 32 ** 0.5)
    q, k, v = block.attn._heads(x, torch.arange(12))
    expected = reference_attention(q, k, v, 0.3, 0.7, window=5)
    mask = block.attn._mask(12, 12, False, None, x.device)  # (layer 0 is local: its window of 5)
    torch.testing.assert_close(block.attn._attend(q, k, v, mask, False).double(), expected, rtol=0, atol=1e-5)
    # A KV cache (token by token) and a static cache give the full forward's logits.
    cache, static = model.new_kv_cache(2, 12), model.new_static_kv_cache(2, 12)
    stepped = torch.cat([model(tokens[:, i:i + 1], kv_cache=cache) for i in range(12)], dim=1)
    torch.testing.assert_close(stepped, fast_logits, rtol=0, atol=2e-5)
    positions = torch.arange(12)
    torch.testing.assert_close(model(tokens, positions=positions, kv_cache=static), fast_logits, rtol=0, atol=2e-5)


def test_gradients_through_both_caps_agree_between_the_paths():
    model = perturbed(TransformerLM(ModelConfig(**CAPPED))).train()
    readable = copy.deepcopy(model)
    for module in readable.modules():
        if hasattr(module, "impl"):
            module.impl = "readable"
    readable.config.impl = "readable"
    tokens = torch.randint(0, 53, (2, 10), generator=torch.Generator().manual_seed(1))
    for m in (model, readable):
        m(tokens).logsumexp(-1).sum().backward()
    for (name, a), b in zip(model.named_parameters(), readable.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("field", ["attn_softcap", "logit_softcap"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_cap_must_be_a_positive_number(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive number or None"):
        ModelConfig(**{field: value})


def test_centring_the_logits_is_refused_where_a_cap_would_change_them():
    """softmax ignores a shift of every logit, a cap does not: interp's center_unembed refuses a capped
    model and process_weights leaves that step out (as TransformerLens does), keeping its log-probs."""
    from glasslm.interp import weights

    model = perturbed(TransformerLM(ModelConfig(**CAPPED)))
    with pytest.raises(ValueError, match="soft-capped"):
        weights.center_unembed(model)
    tokens = torch.randint(0, 53, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(tokens).log_softmax(-1)
        weights.process_weights(model)
        torch.testing.assert_close(model(tokens).log_softmax(-1), before, rtol=0, atol=1e-4)

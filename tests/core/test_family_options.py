"""The ModelConfig options Pythia, Qwen3 and Gemma 3 need, each against a reference written here from
PyTorch functional ops: partial rotary, (1 + w) RMSNorm, q/k norms, parallel residual, sandwich norms,
per-layer sliding windows with their own RoPE base (KV cache and static cache equal to no cache past
the window), and their parameter accounting.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glasslm.core.config import ModelConfig
from glasslm.core.layers import RMSNorm
from glasslm.core.model import TransformerLM
from glasslm.core.positions import RotaryPositions
from glasslm.interp.accounting import cost_table

GEMMA_LIKE = dict(vocab_size=53, context_length=40, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_head=8,
                  d_mlp=48, positional="rope", norm="rmsnorm", mlp="swiglu", activation="gelu_tanh", bias=False,
                  qk_norm=True, post_norms=True, norm_unit_offset=True, scale_embeddings=True, attn_scale=0.3,
                  sliding_window=5, global_layers=(1,), rope_local_theta=100.0, rope_theta=10000.0)


def perturbed(model: TransformerLM, seed: int = 0) -> TransformerLM:
    """Every parameter random (norm gains and biases too), so none can be silently ignored."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("impl", ["fast", "readable"])
def test_partial_rotary_rotates_the_first_dims_and_passes_the_rest(impl):
    x = torch.randn(2, 3, 7, 12)
    positions = torch.arange(7)
    partial = RotaryPositions.from_config(ModelConfig(d_model=48, n_heads=4, positional="rope", rotary_dims=4,
                                                      impl=impl))
    full4 = RotaryPositions(64, 4, 10000.0, impl=impl)  # a rotary of head size 4: the same frequencies
    out = partial(x, positions)
    torch.testing.assert_close(out[..., 4:], x[..., 4:], rtol=0, atol=0)
    torch.testing.assert_close(out[..., :4], full4(x[..., :4], positions))
    # Closed form: pair (x0, x1) at position p turns by p * theta^(-0/4); pair (x2, x3) by p * theta^(-2/4).
    angle = positions[:, None].double() * torch.tensor([1.0, 10000.0 ** -0.5], dtype=torch.float64)
    z = torch.view_as_complex(x[..., :4].double().unflatten(-1, (2, 2)).contiguous()) * torch.polar(
        torch.ones_like(angle), angle)
    torch.testing.assert_close(out[..., :4].double(), torch.view_as_real(z).flatten(-2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["fast", "readable"])
def test_rmsnorm_with_unit_offset_is_rms_norm_times_one_plus_w(impl):
    norm = RMSNorm(16, eps=1e-6, impl=impl, unit_offset=True)
    assert torch.equal(norm.weight, torch.zeros(16))  # starts as the identity gain
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), weight=1 + norm.weight, eps=1e-6))


def test_qk_norm_normalises_each_heads_queries_and_keys_before_the_rotary():
    c = ModelConfig(**{**GEMMA_LIKE, "sliding_window": None, "global_layers": (), "rope_local_theta": None})
    attn = perturbed(TransformerLM(c)).blocks[0].attn
    x = torch.randn(2, 6, 32)
    positions = torch.arange(6)
    q, k, v = attn.qkv(x).split([32, 16, 16], dim=-1)
    q = F.rms_norm(q.view(2, 6, 4, 8), (8,), weight=1 + attn.q_norm.weight, eps=c.norm_eps).transpose(1, 2)
    k = F.rms_norm(k.view(2, 6, 2, 8), (8,), weight=1 + attn.k_norm.weight, eps=c.norm_eps).transpose(1, 2)
    q, k = attn.rotary(q, positions), attn.rotary(k, positions)
    z = F.scaled_dot_product_attention(q, k, v.view(2, 6, 2, 8).transpose(1, 2), is_causal=True, scale=0.3,
                                       enable_gqa=True)
    expected = attn.out(z.transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(attn(x, positions), expected)


def test_whole_projection_qk_norms_normalise_all_heads_at_once_and_keep_their_hooks():
    """OLMoE's q/k norms: one RMSNorm over the whole query projection (n_heads x d_head features) and one
    over the keys (n_kv_heads x d_head), before the rotary; hook_q_normed still sees (batch, heads, seq, d_head)."""
    c = ModelConfig(**{**GEMMA_LIKE, "sliding_window": None, "global_layers": (), "rope_local_theta": None,
                       "norm_unit_offset": False, "qk_norm_whole": True})
    attn = perturbed(TransformerLM(c)).blocks[0].attn
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (16,)
    x, positions = torch.randn(2, 6, 32), torch.arange(6)
    q, k, v = attn.qkv(x).split([32, 16, 16], dim=-1)
    q = F.rms_norm(q, (32,), weight=attn.q_norm.weight, eps=c.norm_eps).view(2, 6, 4, 8).transpose(1, 2)
    k = F.rms_norm(k, (16,), weight=attn.k_norm.weight, eps=c.norm_eps).view(2, 6, 2, 8).transpose(1, 2)
    seen = {}
    attn.hook_q_normed.register_forward_hook(lambda module, args, out: seen.setdefault("q", out.clone()))
    q_rot, k_rot = attn.rotary(q, positions), attn.rotary(k, positions)
    z = F.scaled_dot_product_attention(q_rot, k_rot, v.view(2, 6, 2, 8).transpose(1, 2), is_causal=True, scale=0.3,
                                       enable_gqa=True)
    expected = attn.out(z.transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(attn(x, positions), expected)
    torch.testing.assert_close(seen["q"], q)
    with pytest.raises(ValueError, match="qk_norm_whole .* needs qk_norm=True"):
        ModelConfig(qk_norm_whole=True)


def test_parallel_residual_adds_both_sublayers_of_the_same_input():
    c = ModelConfig(vocab_size=31, d_model=32, n_heads=4, n_layers=1, positional="rope", rotary_dims=4,
                    parallel_residual=True)
    block = perturbed(TransformerLM(c)).blocks[0]
    x, positions = torch.randn(2, 5, 32), torch.arange(5)
    expected = x + block.attn(block.ln1(x), positions) + block.mlp(block.ln2(x))
    torch.testing.assert_close(block(x, positions), expected)


def test_post_norms_normalise_each_sublayer_output_before_the_residual_add():
    block = perturbed(TransformerLM(ModelConfig(**GEMMA_LIKE))).blocks[0]
    x, positions = torch.randn(2, 5, 32), torch.arange(5)
    mid = x + block.ln1_post(block.attn(block.ln1(x), positions))
    expected = mid + block.ln2_post(block.mlp(block.ln2(mid)))
    torch.testing.assert_close(block(x, positions), expected)


def test_layers_get_their_own_window_and_rope_base():
    model = TransformerLM(ModelConfig(**GEMMA_LIKE))
    assert [b.attn.sliding_window for b in model.blocks] == [5, None, 5]
    local, global_ = model.blocks[0].attn.rotary, model.blocks[1].attn.rotary
    assert model.blocks[2].attn.rotary is local and local is not global_
    # The angle at position 1 is the frequency of each pair: base^(-2i/d).
    for rotary, theta in ((local, 100.0), (global_, 10000.0)):
        expected = theta ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
        torch.testing.assert_close(torch.atan2(rotary.sin[1], rotary.cos[1]).double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("impl", ["fast", "readable"])
@torch.no_grad()
def test_kv_cache_and_static_cache_equal_no_cache_past_the_window(impl):
    model = perturbed(TransformerLM(ModelConfig(**{**GEMMA_LIKE, "impl": impl})))
    tokens = torch.randint(0, 53, (1, 16), generator=torch.Generator().manual_seed(2))  # 16 > window 5
    full = model(tokens)
    for static in (False, True):
        cache = model.new_static_kv_cache(1, 40) if static else model.new_kv_cache(1, 40)
        steps = [model(tokens[:, :3], positions=torch.arange(3), kv_cache=cache)]
        for t in range(3, 16):
            kwargs = {"positions": torch.tensor([t])} if static else {}
            steps.append(model(tokens[:, t:t + 1], kv_cache=cache, **kwargs))
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_accounting_counts_the_new_components():
    c = ModelConfig(**GEMMA_LIKE)
    rows = {row.name: row for row in cost_table(c)}
    assert rows["blocks.*.ln1_post"].parameters == rows["blocks.*.ln2_post"].parameters == 3 * 32
    # q/k norms belong to attention: q, k, v, o matrices plus two d_head gains per layer.
    assert rows["blocks.*.attn"].parameters == 3 * (32 * (32 + 16 + 16) + 32 * 32 + 2 * 8)
    assert rows["blocks.*.attn"].forward_flops_per_token == 3 * 2 * (32 * 64 + 32 * 32)
    assert sum(r.parameters for r in rows.values()) == TransformerLM(c).num_parameters()
    # Attention over the sequence: layers 0 and 2 see their window of 5 keys, layer 1 the whole 40.
    assert rows["attention q·kᵀ and pattern·v"].forward_flops_per_token == 2 * 2 * (5 + 40 + 5) * 4 * 8


@pytest.mark.parametrize("fields, message", [
    (dict(rotary_dims=3), "rotary_dims"), (dict(rotary_dims=16), "rotary_dims"),
    (dict(global_layers=(0,)), "global_layers"), (dict(sliding_window=4, global_layers=(5,)), "global_layers"),
    (dict(norm_unit_offset=True), "norm_unit_offset"), (dict(post_norms=True, norm_placement="post"), "post_norms"),
    (dict(rope_scaling="yarn", rope_beta_fast=1.0), "rope_beta_fast"), (dict(rope_scaling="linear", rope_factor=0.5),
                                                                         "rope_factor"),
])
def test_bad_option_values_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(d_model=32, n_heads=4, n_layers=2, positional="rope", **fields)

"""The per-site config switches (biases, dropout, norm variant, score scale, init), each against
an independent reference: torch functional ops, closed forms, or PyTorch's own modules."""

import math

import pytest
import torch
import torch.nn.functional as F

from glasslm.core.config import ModelConfig
from glasslm.presets import get_preset
from glasslm.core.layers import LayerNorm
from glasslm.core.model import TransformerLM

SMALL = dict(vocab_size=61, context_length=16, d_model=24, n_layers=2, n_heads=3)


def test_bias_shorthand_and_per_site_switches():
    names = lambda cfg: {n for n, _ in TransformerLM(cfg).named_parameters() if "bias" in n}  # noqa: E731
    assert names(ModelConfig(**SMALL, bias=False)) == set()
    everywhere = names(ModelConfig(**SMALL))
    assert {"blocks.0.attn.qkv.bias", "blocks.0.attn.out.bias", "blocks.0.mlp.up.bias", "blocks.0.ln1.bias",
            "ln_final.bias"} <= everywhere and "unembed_bias" not in everywhere  # GPT-2 has no logit bias
    only_mlp = names(ModelConfig(**SMALL, bias=False, mlp_bias=True))
    assert only_mlp == {f"blocks.{i}.mlp.{p}.bias" for i in range(2) for p in ("up", "down")}
    seed004 = names(ModelConfig(**SMALL, attn_qkv_bias=False, tie_embeddings=False, unembed_bias=True))
    assert "blocks.0.attn.qkv.bias" not in seed004 and {"blocks.0.attn.out.bias", "unembed_bias"} <= seed004
    # Changing the shorthand resets the sites it covers (unless given in the same call).
    assert names(ModelConfig(**SMALL, attn_qkv_bias=False).replace(bias=True)) == everywhere


def test_unembedding_bias_is_added_to_the_logits():
    model = TransformerLM(ModelConfig(**SMALL, tie_embeddings=False, unembed_bias=True)).eval()
    tokens = torch.randint(0, 61, (2, 5))
    before = model(tokens)
    with torch.no_grad():
        model.unembed_bias.copy_(torch.randn(61))
    torch.testing.assert_close(model(tokens), before + model.unembed_bias, rtol=0, atol=1e-6)


def test_unbiased_std_layernorm_matches_its_closed_form():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    norm = LayerNorm(16, eps=1e-6, unbiased_std=True).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16)), norm.bias.copy_(torch.randn(16))
    n = x.shape[-1]
    centred = x - x.sum(-1, keepdim=True) / n
    std = (centred.pow(2).sum(-1, keepdim=True) / (n - 1)).sqrt()  # Bessel-corrected
    torch.testing.assert_close(norm(x), norm.weight * centred / (std + 1e-6) + norm.bias)
    # ...and it is not the ordinary LayerNorm.
    assert not torch.allclose(norm(x), F.layer_norm(x, (16,), norm.weight, norm.bias, 1e-6))


@pytest.mark.parametrize("impl", ["fast", "readable"])
def test_attention_scale_by_d_model_or_a_number(impl):
    torch.manual_seed(0)
    base = ModelConfig(**SMALL, impl=impl)
    by_model = base.replace(attn_scale_by="d_model")
    assert by_model.attn_score_scale == 1 / math.sqrt(24) and base.attn_score_scale == 1 / math.sqrt(8)
    assert base.replace(attn_scale=0.5).attn_score_scale == 0.5
    model = TransformerLM(by_model).eval()
    attn, x = model.blocks[0].attn, torch.randn(2, 7, 24)
    q, k, v = attn.qkv(x).split(24, dim=-1)
    heads = lambda t: t.view(2, 7, 3, 8).transpose(1, 2)  # noqa: E731
    z = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True, scale=24 ** -0.5)
    expected = attn.out(z.transpose(1, 2).reshape(2, 7, 24))
    torch.testing.assert_close(attn(x, torch.arange(7)), expected, rtol=1e-5, atol=1e-6)


def test_dropout_per_site_and_the_old_shorthand():
    cfg = ModelConfig(**SMALL, dropout=0.15, attn_dropout=0.1, mlp_hidden_dropout=0.2)
    assert [cfg.site_dropout(s) for s in ("embed", "attn", "attn_out", "mlp_out")] == [0.15, 0.1, 0.15, 0.15]
    assert cfg.mlp_hidden_dropout == 0.2  # not covered by `dropout`: nanoGPT-style models have none there
    off = cfg.replace(dropout=0.0)
    assert [off.site_dropout(s) for s in ("embed", "attn", "attn_out", "mlp_out")] == [0.0] * 4
    with pytest.raises(ValueError, match="attn_dropout must be in"):
        ModelConfig(**SMALL, attn_dropout=1.0)
    # Each site alone makes training-mode outputs random, and eval mode deterministic.
    tokens = torch.randint(0, 61, (2, 9))
    for site in ("embed_dropout", "attn_dropout", "attn_out_dropout", "mlp_hidden_dropout", "mlp_out_dropout"):
        model = TransformerLM(ModelConfig(**SMALL, **{site: 0.5}))
        assert not torch.equal(model(tokens), model(tokens)), site
        model.eval()
        assert torch.equal(model(tokens), model(tokens)), site


def _q_k_v(model: TransformerLM, layer: int = 0) -> list[torch.Tensor]:
    c = model.config
    return list(model.blocks[layer].attn.qkv.weight.detach().split(c.n_heads * c.d_head, dim=0))


def test_fan_based_inits_see_each_of_q_k_v_not_the_fused_matrix():
    torch.manual_seed(0)
    d = 256
    cfg = ModelConfig(vocab_size=64, context_length=8, d_model=d, n_layers=1, n_heads=4, bias=False)
    for init, expected_std in (("truncated_normal", math.sqrt(2 / (d + d)) * 0.9866),  # 3-std cut shrinks std
                               ("xavier", math.sqrt(2 / (d + d)))):
        for w in _q_k_v(TransformerLM(cfg.replace(init=init))):
            assert w.std().item() == pytest.approx(expected_std, rel=0.03), init
    trunc = _q_k_v(TransformerLM(cfg.replace(init="truncated_normal")))[0]
    assert trunc.abs().max() <= 3 * math.sqrt(2 / (d + d)) + 1e-6


def test_gpt2_init_with_and_without_residual_scaling():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, context_length=8, d_model=256, n_layers=8, n_heads=4)
    scaled = TransformerLM(cfg).blocks[0].attn.out.weight.std().item()
    plain = TransformerLM(cfg.replace(init_residual_scaling=False)).blocks[0].attn.out.weight.std().item()
    assert scaled == pytest.approx(0.02 / math.sqrt(16), rel=0.05) and plain == pytest.approx(0.02, rel=0.05)


def test_torch_init_matches_pytorchs_own_modules():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, context_length=64, d_model=256, n_layers=1, n_heads=4, init="torch",
                      tie_embeddings=False, unembed_bias=True)
    model = TransformerLM(cfg)
    reference = torch.nn.Linear(256, 1024)
    up = model.blocks[0].mlp.up
    bound = 1 / math.sqrt(256)  # nn.Linear: weight and bias uniform in +-1/sqrt(fan_in)
    for ours, theirs in ((up.weight, reference.weight), (up.bias, reference.bias)):
        assert ours.abs().max() <= bound and ours.std().item() == pytest.approx(theirs.std().item(), rel=0.05)
    assert model.embed.weight.std().item() == pytest.approx(torch.nn.Embedding(512, 256).weight.std().item(),
                                                            rel=0.05)
    assert model.unembed_bias.abs().max() <= bound and model.unembed_bias.std() > bound / 3


def test_existing_presets_keep_their_semantics():
    small = get_preset("gpt2-small")
    assert all(small.site_bias(s) for s in ("qkv", "out", "mlp", "norm")) and not small.unembed_bias
    assert small.init_residual_scaling and small.attn_score_scale == 1 / 8

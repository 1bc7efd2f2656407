"""The whole model: causality, fast == readable, KV cache, input errors, parameter counts, init."""

import math

import jaxtyping
import pytest
import torch

from glasslm.presets import PRESETS, get_preset
from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM

# Small members of each family, quick to run on 2 cores.
FAMILIES = {
    "gpt2": get_preset("gpt2-small", vocab_size=97, context_length=32, d_model=48, n_layers=2, n_heads=4),
    "llama": get_preset("llama-tiny", vocab_size=97, context_length=32, d_model=48, n_layers=2, n_heads=4,
                        n_kv_heads=2, d_mlp=96),
    "vaswani": get_preset("vaswani-decoder", vocab_size=97, context_length=32, d_model=48, n_layers=2, n_heads=4,
                          d_mlp=96, dropout=0.0),
    "tiny-transformer": get_preset("tiny-transformer", vocab_size=97, context_length=32, dropout=0.0),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_at_t_ignores_tokens_after_t(family):
    model = TransformerLM(FAMILIES[family]).eval()
    tokens = torch.randint(0, 97, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 97, (2, 8))
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=1e-5, rtol=1e-5)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3  # and the later positions do see them


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_and_readable_models_agree_with_gradients(family):
    fast = TransformerLM(FAMILIES[family].replace(impl="fast"))
    readable = TransformerLM(FAMILIES[family].replace(impl="readable"))
    readable.load_state_dict(fast.state_dict())
    tokens = torch.randint(0, 97, (3, 32))
    out_fast, out_readable = fast(tokens), readable(tokens)
    torch.testing.assert_close(out_fast, out_readable, atol=2e-5, rtol=1e-4)
    out_fast.square().mean().backward()
    out_readable.square().mean().backward()
    for (name, a), b in zip(fast.named_parameters(), readable.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["fast", "readable"])
def test_kv_cache_steps_equal_full_forward(family, impl):
    model = TransformerLM(FAMILIES[family].replace(impl=impl)).eval()
    tokens = torch.randint(0, 97, (2, 24))
    full = model(tokens)
    cache = model.new_kv_cache(batch=2)
    pieces = [model(tokens[:, :10], kv_cache=cache)]  # prefill
    pieces += [model(tokens[:, 10:13], kv_cache=cache)]  # a chunk of three
    pieces += [model(tokens[:, t:t + 1], kv_cache=cache) for t in range(13, 24)]  # one at a time
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-4)


def test_bad_inputs_raise_clear_errors(unchecked_shapes):
    model = TransformerLM(FAMILIES["gpt2"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[1, 97]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="longer than the context length"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer ids"):
        model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="at least one position"):
        model(torch.zeros(1, 0, dtype=torch.long))


def expected_parameters(c: ModelConfig) -> int:
    """Parameter count from the architecture's formula, written independently of the model code."""
    d, L, V, T = c.d_model, c.n_layers, c.vocab_size, c.context_length
    d_q, d_kv = c.n_heads * c.d_head, c.n_kv_heads * c.d_head

    def has_bias(own: bool | None) -> bool:  # a per-site switch, else the `bias` shorthand
        return c.bias if own is None else own

    norm = d * (2 if c.norm == "layernorm" and has_bias(c.norm_bias) else 1)
    attn = d * (d_q + 2 * d_kv) + d_q * d + has_bias(c.attn_qkv_bias) * (d_q + 2 * d_kv) + has_bias(c.attn_out_bias) * d
    attn += 2 * c.d_head if c.qk_norm else 0  # one RMSNorm gain over d_head for queries, one for keys
    if c.mlp == "none":  # attention-only: no MLP and no norm before (or after) it
        mlp = -norm * (2 if c.post_norms else 1)
    elif c.mlp == "swiglu":
        mlp = 3 * d * c.d_mlp + has_bias(c.mlp_bias) * (2 * c.d_mlp + d)
    else:
        mlp = 2 * d * c.d_mlp + has_bias(c.mlp_bias) * (c.d_mlp + d)
    total = V * d + L * (attn + mlp + (4 if c.post_norms else 2) * norm)
    if c.n_experts:  # a mixture-of-experts layer: n SwiGLU experts, a router (n x d), Qwen2-MoE's shared expert
        moe = c.n_experts * (3 * d * (c.d_expert or c.d_mlp) + d)
        moe += 3 * d * c.d_shared_expert + d if c.d_shared_expert else 0
        total += sum(moe - mlp for layer in range(L) if (layer + 1) % c.moe_every == 0)
    total += T * d if c.positional == "learned" else 0
    total += norm if c.final_norm else 0
    total += 0 if c.tie_embeddings else V * d
    total += V if c.unembed_bias else 0
    return total


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_counts(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = TransformerLM(cfg)
    assert model.num_parameters() == expected_parameters(cfg)
    assert sum(model.num_parameters(by_component=True).values()) == model.num_parameters()


def test_gpt2_small_has_exactly_124_439_808_parameters():
    with torch.device("meta"):
        model = TransformerLM(get_preset("gpt2-small"))
    assert model.num_parameters() == 124_439_808


def test_gpt2_init_scales_residual_projections():
    cfg = get_preset("gpt2-small", n_layers=6, d_model=256, n_heads=4, vocab_size=1000, context_length=64)
    model = TransformerLM(cfg)
    std = 0.02 / math.sqrt(2 * 6)
    out = torch.cat([b.attn.out.weight.flatten() for b in model.blocks])
    assert out.std().item() == pytest.approx(std, rel=0.05)
    up = torch.cat([b.mlp.up.weight.flatten() for b in model.blocks])
    assert up.std().item() == pytest.approx(0.02, rel=0.05)
    assert all((b.attn.qkv.bias == 0).all() for b in model.blocks)


def test_truncated_normal_and_xavier_init():
    cfg = get_preset("gpt2-small", n_layers=2, d_model=128, n_heads=4, vocab_size=500, context_length=64)
    model = TransformerLM(cfg.replace(init="truncated_normal"))
    w = model.blocks[0].mlp.up.weight  # (512, 128)
    std = math.sqrt(2 / (128 + 512))
    assert w.abs().max().item() <= 3 * std + 1e-7
    assert w.std().item() == pytest.approx(std * 0.986, rel=0.05)  # a ±3σ cut shrinks σ by ~1.4%
    assert model.embed.weight.abs().max().item() <= 3.0
    model = TransformerLM(cfg.replace(init="xavier"))
    w = model.blocks[0].mlp.up.weight
    bound = math.sqrt(6 / (128 + 512))
    assert w.abs().max().item() <= bound
    assert w.abs().max().item() > 0.95 * bound


def test_post_norm_block_outputs_are_normalised():
    model = TransformerLM(FAMILIES["vaswani"]).eval()
    block_out = {}
    model.blocks[0].hook_resid_post.register_forward_hook(lambda m, i, o: block_out.setdefault("x", o))
    model(torch.randint(0, 97, (2, 10)))
    x = block_out["x"]
    torch.testing.assert_close(x.mean(-1), torch.zeros(2, 10), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.var(-1, unbiased=False), torch.ones(2, 10), atol=1e-3, rtol=0)


def test_tied_embeddings_share_one_tensor():
    model = TransformerLM(FAMILIES["gpt2"])
    assert model.unembed is None
    untied = TransformerLM(FAMILIES["llama"])
    assert untied.unembed is not None and untied.unembed.weight.data_ptr() != untied.embed.weight.data_ptr()


def test_scaled_embeddings_multiply_by_sqrt_d_model():
    cfg = FAMILIES["vaswani"]
    model = TransformerLM(cfg).eval()
    seen = {}
    model.blocks[0].hook_resid_pre.register_forward_hook(lambda m, i, o: seen.setdefault("x", o))
    tokens = torch.tensor([[3, 5]])
    model(tokens)
    expected = model.embed.weight[tokens] * math.sqrt(cfg.d_model) + model.pos_embed.table[:2]
    torch.testing.assert_close(seen["x"], expected)


def test_shape_annotations_are_checked_while_testing():
    """conftest installs jaxtyping's import hook on the core, so an annotation is a checked claim."""
    model = TransformerLM(get_preset("llama-tiny"))
    with pytest.raises(jaxtyping.TypeCheckError, match="tokens"):
        model(torch.zeros(5, dtype=torch.long))  # (seq,) where (batch, seq) is annotated
    out = model(torch.zeros(2, 5, dtype=torch.long), last_logits_only=True)
    assert out.shape == (2, 1, model.config.vocab_size)  # the annotation's out_seq = 1

"""Pythia (GPT-NeoX), Qwen3 and Gemma 3, and the linear / yarn RoPE scalings, each from a tiny random
config saved by transformers: logits within twice transformers' own float32-vs-float64 error, 20
greedy tokens equal to transformers' (full forward, KV cache, static cache), export -> import ->
export byte-identical, special token ids carried both ways. Nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Gemma2Config, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, Phi3Config, Qwen3Config,
)

from glasslm.generation import generate_tokens  # noqa: E402
from glasslm.hf import export_hf, import_hf  # noqa: E402
from tests.hf.test_hf_families import VOCAB, _llama, float32_rounding, greedy, random_model  # noqa: E402

SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = {
    # Pythia's shape scaled down: rotary on a quarter of each 16-wide head, parallel attention + MLP.
    "pythia-shape": lambda: GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.25}, **SPECIAL),
    # GPT-NeoX with the sequential residual (use_parallel_residual=False) and half the head rotated.
    "gpt-neox-sequential": lambda: GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
        max_position_embeddings=64, use_parallel_residual=False, hidden_act="gelu_new",
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}, **SPECIAL),
    # Qwen3: q/k norms, head_dim 16 over a d_model of 40, tied.
    "qwen3-shape": lambda: Qwen3Config(**{**_llama(hidden_size=40, head_dim=16, tie_word_embeddings=True,
                                                   rope_theta=1000000.0), **SPECIAL}),
    # Gemma 3: windows of 6 on layers 0, 1, 3 (shorter than the 24-token sequences), layer 2 global.
    "gemma3-shape": lambda: Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=6, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}, **SPECIAL),
    # Gemma 2: windows of 6 on the even layers, soft-capped scores and logits (caps small enough to bite
    # on these random weights). Eager attention: transformers' SDPA path has no cap.
    "gemma2-shape": lambda: Gemma2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=6, query_pre_attn_scalar=20,
        attn_logit_softcapping=3.0, final_logit_softcapping=5.0, attn_implementation="eager", **SPECIAL),
    # Phi-4-mini's shape: q|k|v and gate|up fused, RoPE on 3/4 of each 16-wide head, tied, grouped heads.
    "phi4-mini-shape": lambda: Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}, **SPECIAL),
    "llama-rope-linear": lambda: LlamaConfig(**_llama(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    # An original context of 16 so that the ramp spans the 6 frequencies of a 12-wide head.
    "llama-rope-yarn": lambda: LlamaConfig(**_llama(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 4.0, "beta_slow": 1.0})),
}


def decode(model, prompt, n, static):
    """n greedy tokens through a KV cache (a StaticKVCache addressed by position, if `static`)."""
    cache = model.new_static_kv_cache(1, 64) if static else model.new_kv_cache(1, 64)
    pos = torch.arange(prompt.shape[1])
    logits = model(prompt, positions=pos, kv_cache=cache) if static else model(prompt, kv_cache=cache)
    out = []
    for step in range(n):
        out.append(int(logits[0, -1].argmax()))
        token = torch.tensor([[out[-1]]])
        p = torch.tensor([prompt.shape[1] + step])
        logits = model(token, positions=p, kv_cache=cache) if static else model(token, kv_cache=cache)
    return out


@pytest.mark.slow  # ~10 s a family: two models, 20 greedy tokens four ways, three exports
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_new_family_logits_greedy_tokens_and_round_trip(family, tmp_path):
    hf_model = random_model(FAMILIES[family]())
    hf_model.save_pretrained(tmp_path / "hf")
    model = import_hf(tmp_path / "hf")
    tokens = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = hf_model(tokens).logits
    assert expected.abs().max() > 1.0
    atol = 2 * float32_rounding(hf_model, tokens)  # every family here within the rule, yarn included
    assert atol < 1e-5 * expected.abs().max(), "HF's float32 logits should be within ~100 ulps of float64"
    for impl in ("fast", "readable"):
        model.config.impl = impl
        for module in model.modules():
            if hasattr(module, "impl"):
                module.impl = impl
        got = model(tokens)
        print(f"{family} [{impl}]: max |logit diff| {(got - expected).abs().max().item():.2e}, tolerance {atol:.2e}")
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)

    assert_decodes_like_transformers_and_round_trips(model, hf_model, tokens, expected, tmp_path)


def assert_decodes_like_transformers_and_round_trips(model, hf_model, tokens, expected, tmp_path) -> None:
    """20 greedy tokens from the first row's first 4 equal to transformers' (full forward, KV cache, static
    cache, the readable step), export -> import -> export byte-identical, and the export read back by
    transformers to its own logits `expected` of `tokens`."""
    prompt = tokens[:1, :4]
    hf_tokens = hf_model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, 4:].tolist()
    assert greedy(model, prompt, 20) == hf_tokens
    assert decode(model, prompt, 20, static=False) == hf_tokens
    assert decode(model, prompt, 20, static=True) == hf_tokens
    assert list(generate_tokens(model, prompt[0].tolist(), 20, temperature=0.0)) == hf_tokens

    first = export_hf(model, tmp_path / "first")
    again = export_hf(import_hf(first), tmp_path / "second")
    for name in ("config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(first).eval()
    assert type(reloaded) is type(hf_model)
    torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-6, rtol=0)  # same weights, same code


@pytest.mark.parametrize("family", ["llama-rope-linear", "llama-rope-yarn"])
def test_scaled_frequencies_match_transformers(family):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from glasslm.core.positions import RotaryPositions
    from glasslm.hf import config_from_hf

    hf_config = FAMILIES[family]()
    hf_freq, hf_gain = ROPE_INIT_FUNCTIONS[hf_config.rope_parameters["rope_type"]](hf_config, "cpu")
    config, _ = config_from_hf(hf_config.to_dict())
    ours = RotaryPositions.from_config(config)
    ours_freq = torch.atan2(ours.sin[1], ours.cos[1])  # the angle at position 1 is the frequency
    torch.testing.assert_close(ours_freq, hf_freq.float(), rtol=1e-6, atol=0)
    gain = torch.hypot(ours.sin[1], ours.cos[1])  # |gain * (cos, sin)|
    torch.testing.assert_close(gain, torch.full_like(gain, hf_gain), rtol=1e-6, atol=0)
    plain = 10000.0 ** (-torch.arange(0, 12, 2, dtype=torch.float64) / 12)
    ratio = (plain / ours_freq.double()).tolist()
    assert abs(ratio[-1] - 4) < 1e-4  # the slowest pair slowed by the factor in both
    assert abs(ratio[0] - (4 if family.endswith("linear") else 1)) < 1e-4  # yarn keeps the fastest


@pytest.mark.parametrize("preset, hf_class, hf_config", [
    ("pythia-160m", GPTNeoXConfig, dict(vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                        intermediate_size=3072, max_position_embeddings=2048)),
    ("qwen3-0.6b", Qwen3Config, dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                     num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                     max_position_embeddings=40960, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ("gemma3-270m", Gemma3TextConfig, dict(vocab_size=262144, hidden_size=640, num_hidden_layers=18,
                                           num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                           intermediate_size=2048, max_position_embeddings=32768, sliding_window=512)),
])
def test_preset_parameter_counts_equal_transformers(preset, hf_class, hf_config):
    from glasslm.hf import config_from_hf
    from glasslm.interp.accounting import parameter_count
    from glasslm.presets import get_preset

    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_class(**hf_config))
    expected = sum(p.numel() for p in hf_model.parameters())  # tied weights are one parameter there too
    assert parameter_count(get_preset(preset)) == expected
    config, _ = config_from_hf(hf_class(**hf_config).to_dict())  # the preset is what the HF config says
    assert config.replace(init=get_preset(preset).init) == get_preset(preset)


@pytest.mark.slow
@torch.no_grad()
def test_dynamic_ntk_scaling_past_the_original_context(tmp_path):
    # transformers recomputes the frequencies for each call's length past max_position_embeddings (16
    # here); glasslm does the same once imported with a longer context. Within 16 it is plain RoPE.
    hf_model = random_model(LlamaConfig(**_llama(max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})))
    hf_model.save_pretrained(tmp_path / "hf")
    model = import_hf(tmp_path / "hf", context_length=64)
    assert (model.config.rope_scaling, model.config.rope_original_context) == ("dynamic", 16)
    tokens = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 > 16
    rotary = model.blocks[0].attn.rotary
    assert torch.equal(rotary._cos_sin(torch.arange(16))[0], rotary.cos[:16])  # plain RoPE within 16
    assert not torch.allclose(rotary._cos_sin(torch.arange(24))[0], rotary.cos[:24], atol=1e-3)  # slower past it
    for n in (12, 24):  # within and past the original context
        expected = hf_model(tokens[:, :n]).logits
        atol = 2 * float32_rounding(hf_model, tokens[:, :n])
        got = model(tokens[:, :n])
        print(f"dynamic, {n} tokens: max |logit diff| {(got - expected).abs().max().item():.2e}, tolerance {atol:.2e}")
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    prompt = tokens[:1, :4]
    # Cached keys keep the rotation of the length they were made at, in both libraries, so cached and
    # uncached greedy decoding differ past 16 tokens; each matches transformers' counterpart.
    assert greedy(model, prompt, 20) == greedy(lambda t: hf_model(t).logits, prompt, 20)
    hf_cached = hf_model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, 4:].tolist()
    assert decode(model, prompt, 20, static=False) == hf_cached
    first = export_hf(model, tmp_path / "first")
    again = export_hf(import_hf(first, context_length=64), tmp_path / "second")
    for name in ("config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name


@torch.no_grad()
def test_a_full_rotary_phi3_is_read_as_itself_and_written_as_the_mistral_it_computes(tmp_path):
    """Phi-3-mini's shape (every head feature rotates, a window on every layer): what a Mistral of the
    same numbers computes, so glasslm writes it as one (a config a Llama-shaped family can say is not
    claimed by Phi-3: families' recognisers do not overlap)."""
    hf_model = random_model(Phi3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, sliding_window=6, **SPECIAL))
    hf_model.save_pretrained(tmp_path / "hf")
    model = import_hf(tmp_path / "hf")
    assert (model.config.sliding_window, model.config.rotary_dims) == (6, None)
    tokens = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = hf_model(tokens).logits
    torch.testing.assert_close(model(tokens), expected, atol=2 * float32_rounding(hf_model, tokens), rtol=0)
    prompt = tokens[:1, :4]
    hf_tokens = hf_model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, 4:].tolist()
    assert decode(model, prompt, 20, static=False) == hf_tokens
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export_hf(model, tmp_path / "out")).eval()
    assert type(reloaded).__name__ == "MistralForCausalLM"
    torch.testing.assert_close(reloaded(tokens).logits, expected, atol=2 * float32_rounding(hf_model, tokens), rtol=0)


def test_longrope_is_refused_by_name(tmp_path):
    from glasslm.hf import UnsupportedModelError

    config = Phi3Config(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
                        max_position_embeddings=64, original_max_position_embeddings=32,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 6,
                                         "long_factor": [2.0] * 6, "original_max_position_embeddings": 32})
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="rope scaling 'longrope' is not supported"):
        import_hf(tmp_path)

"""More Hugging Face families, each from a tiny random config: Llama 3 rope scaling, Qwen2
(q/k/v biases, head_dim != d_model / n_heads), Mistral (sliding-window attention), Llama with
biases, and the SmolLM / TinyLlama shapes. Logits within twice HF's own float32 rounding
(~1e-5), 20 greedy tokens equal (full forward and KV-cached), export -> import -> export
byte-identical. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
)

from glasslm.generation import generate_tokens  # noqa: E402
from glasslm.hf import UnsupportedModelError, export_hf, import_hf  # noqa: E402

VOCAB = 97


def _llama(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base.update(kw)
    return base


FAMILIES = {
    # Llama 3.1's frequency-dependent RoPE stretch; an original context of 16 so that all three
    # regimes (kept, smoothed, slowed) occur among the 8 frequencies of a 16-wide head.
    "llama3-rope-scaling": lambda: LlamaConfig(**_llama(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Qwen2: biases on q/k/v (not o, not the MLP), and heads of 16 over a d_model of 40.
    "qwen2-bias-head-dim": lambda: Qwen2Config(**_llama(hidden_size=40, head_dim=16, tie_word_embeddings=True,
                                                        rope_theta=1000000.0)),
    # Mistral: every query sees its last 6 keys only, shorter than the 24-token test sequences.
    "mistral-sliding-window": lambda: MistralConfig(**_llama(sliding_window=6, head_dim=12)),
    "llama-attention-and-mlp-bias": lambda: LlamaConfig(**_llama(attention_bias=True, mlp_bias=True)),
    # Per-site bias switches (issue 9) let attention and MLP biases differ.
    "llama-attention-bias-only": lambda: LlamaConfig(**_llama(attention_bias=True, mlp_bias=False)),
    # SmolLM-135M's shape scaled down: tied, 9 query heads sharing 3 key/value heads, head 64 -> 8.
    "smollm-shape": lambda: LlamaConfig(**_llama(hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                                                 intermediate_size=192, tie_word_embeddings=True)),
    # TinyLlama-1.1B's shape scaled down: untied, 8 query heads per key/value head.
    "tinyllama-shape": lambda: LlamaConfig(**_llama(hidden_size=64, num_attention_heads=16, num_key_value_heads=2,
                                                    intermediate_size=176)),
}


# HF computes Llama 3's scaled rotary frequencies in float32 (relative error ~3e-7, checked in
# test_llama3_frequencies_match_transformers); glasslm computes them in float64. With these random
# weights that rounding alone moves logits by ~1.7e-5, three times HF's own float32 rounding
# (~6e-6); with HF's float32 table they agree to ~6e-6.
ATOL = {"llama3-rope-scaling": 3e-5}


def float32_rounding(hf_model, tokens) -> float:
    """How far HF's own float32 logits are from the same model run in float64: the rounding this
    computation has on this CPU. Two correct float32 implementations differ by at most about twice
    this; a fixed 1e-5 was exceeded (1.03e-5) by a correct import on an Intel CPU whose kernels
    round differently, where HF's own error was 1.6e-5."""
    high = copy.deepcopy(hf_model).double()
    return (hf_model(tokens).logits.double() - high(tokens).logits).abs().max().item()


def random_model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.25)
    return model


def greedy(forward, prompt, n):
    tokens = prompt.clone()
    for _ in range(n):
        tokens = torch.cat([tokens, forward(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_family_logits_greedy_tokens_and_round_trip(family, tmp_path):
    hf_model = random_model(FAMILIES[family]())
    hf_model.save_pretrained(tmp_path / "hf")
    model = import_hf(tmp_path / "hf")
    # Both attention paths where they differ for the family (the sliding-window mask is built in each).
    for impl in ("fast", "readable") if model.config.sliding_window else ("fast",):
        model.config.impl = impl
        for block in model.blocks:
            block.attn.impl = impl
        tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
        expected = hf_model(tokens).logits
        assert expected.abs().max() > 1.0
        atol = ATOL.get(family, 2 * float32_rounding(hf_model, tokens))
        assert atol < 1e-5 * expected.abs().max(), "HF's float32 logits should be within ~100 ulps of float64"
        got = model(tokens)
        print(f"{family} [{impl}]: max |logit diff| {(got - expected).abs().max().item():.2e}, tolerance {atol:.2e}")
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    prompt = tokens[:1, :4]
    hf_tokens = hf_model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, 4:].tolist()
    assert greedy(model, prompt, 20) == hf_tokens
    assert list(generate_tokens(model, prompt[0].tolist(), 20, temperature=0.0)) == hf_tokens

    first = export_hf(model, tmp_path / "first")
    again = export_hf(import_hf(first), tmp_path / "second")
    for name in ("config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    reloaded = AutoModelForCausalLM.from_pretrained(first).eval()
    assert type(reloaded) is type(hf_model)
    torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-6, rtol=0)  # same weights, same code


def test_llama3_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from glasslm.core.config import ModelConfig
    from glasslm.core.positions import RotaryPositions

    hf_config = FAMILIES["llama3-rope-scaling"]()
    hf_freq, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    assert scale == 1.0
    params = hf_config.rope_parameters
    ours = RotaryPositions.from_config(ModelConfig(
        d_model=48, n_heads=4, positional="rope", rope_theta=params["rope_theta"], rope_scaling="llama3",
        rope_factor=params["factor"], rope_low_freq_factor=params["low_freq_factor"],
        rope_high_freq_factor=params["high_freq_factor"], rope_original_context=params["original_max_position_embeddings"]))
    ours_freq = torch.atan2(ours.sin[1], ours.cos[1])  # the angle at position 1 is the frequency
    torch.testing.assert_close(ours_freq, hf_freq.float(), rtol=1e-6, atol=0)
    plain = 500000.0 ** (-torch.arange(0, 12, 2, dtype=torch.float64) / 12)
    ratio = (plain / ours_freq.double()).tolist()
    assert ratio[0] < 8 * 0.99 and abs(ratio[-1] - 8) < 1e-4  # the high frequency is smoothed, the low slowed 8x


def test_what_remains_unsupported_is_named(tmp_path):
    def write(name, config):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config.to_dict() if hasattr(config, "to_dict") else config))
        return d

    cases = {
        "longrope": ({"model_type": "llama", "rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
                     "rope scaling 'longrope'"),
        # (Llama with attention_bias=True, mlp_bias=False is supported since ModelConfig has per-site bias
        # switches: the "llama-attention-bias-only" family above checks its logits against HF.)
        "qwen2-mixed-window": ({"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
                                "max_window_layers": 2, "sliding_window": 8}, "some layers only"),
        "gelu-llama": ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    }
    for name, (config, message) in cases.items():
        with pytest.raises(UnsupportedModelError, match=message):
            import_hf(write(name, config))

"""Weight-only int8: the rounding bound, fast kernel == readable path, quality on a trained model, files."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from glasslm.checkpoint import load_checkpoint, save_checkpoint
from glasslm.cli import main
from glasslm.core.config import get_preset
from glasslm.data import get_batch
from glasslm.evaluate import evaluate_tokens
from glasslm.generate import generate_tokens
from glasslm.core.model import TransformerLM
from glasslm.quantize import Int8Linear, int8_per_channel, quantize_int8
from glasslm.tokenizers import CharTokenizer


def test_rounding_error_is_at_most_half_a_step_per_channel():
    weight = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]  # very different row scales
    weight[5] = 0.0  # an all-zero row must not divide by zero
    quantized, scales = int8_per_channel(weight)
    assert quantized.dtype == torch.int8 and quantized.abs().max() <= 127
    error = (quantized.float() * scales[:, None] - weight).abs()
    assert torch.all(error <= scales[:, None] / 2 + 1e-7 * weight.abs())  # round-to-nearest: ≤ scale/2
    assert torch.equal(quantized[5], torch.zeros(96, dtype=torch.int8))


@pytest.mark.parametrize("d_in", [128, 40])  # 40: not a multiple of 32, served by the readable path
def test_fast_kernel_matches_the_readable_path_and_the_dequantized_matmul(d_in):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, d_in) * 0.05, torch.randn(96)
    fast = Int8Linear.from_weight(weight, bias, impl="fast")
    readable = Int8Linear.from_weight(weight, bias, impl="readable")
    x = torch.randn(3, 5, d_in)
    reference = F.linear(x, fast.dequantized_weight(), bias)
    assert torch.allclose(readable(x), reference, atol=1e-5)
    # The kernel rounds activations to bfloat16 (8 bits of mantissa): relative error ~2^-8 per product.
    assert torch.allclose(fast(x), reference, atol=3e-2 * reference.abs().max().item())
    assert fast(x).shape == (3, 5, 96)


@pytest.fixture(scope="module")
def trained(shakespeare_text):
    """A small char model trained for a few seconds: quantization must keep what it learned."""
    tokenizer = CharTokenizer.from_text(shakespeare_text)
    ids = np.array(tokenizer.encode(shakespeare_text), dtype=np.int64)
    split = int(0.9 * len(ids))
    # Trained on 64-token windows; a longer context lets one forward pass score 256 greedy steps.
    config = get_preset("llama-tiny", vocab_size=tokenizer.vocab_size, context_length=320, d_model=128,
                        n_layers=2, n_heads=4, n_kv_heads=4)
    torch.manual_seed(0)
    model = TransformerLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(120):
        x, y = get_batch(ids[:split], 16, 64, "cpu", generator=generator)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer, ids[split:split + 4097]


def test_int8_keeps_perplexity_within_one_percent_and_greedy_tokens(trained):
    model, tokenizer, val = trained
    with torch.no_grad():
        fp32 = evaluate_tokens(model, val.tolist())
        prompt = tokenizer.encode("ROMEO:\n")
        greedy = torch.tensor([prompt + list(generate_tokens(model, prompt, max_new_tokens=256, temperature=0.0))])
        fp32_choices = model(greedy)[0, -257:-1].argmax(-1)  # the choice at each of the 256 steps
        quantized = copy.deepcopy(model)
        quantize_int8(quantized)
        int8 = evaluate_tokens(quantized, val.tolist())
        int8_choices = quantized(greedy)[0, -257:-1].argmax(-1)  # same prefixes, int8 weights
    counts = np.bincount(val, minlength=model.config.vocab_size)
    probs = counts[counts > 0] / counts.sum()
    unigram = float(-(probs * np.log(probs)).sum())  # the loss of knowing only character frequencies
    assert fp32["loss"] < unigram - 0.5, "the fixture did not learn enough for this comparison to mean anything"
    perplexity_ratio = math.exp(int8["loss"]) / math.exp(fp32["loss"])
    assert abs(perplexity_ratio - 1) < 0.01, perplexity_ratio
    # At each of the 256 steps, with the same prefix, the int8 model picks the fp32 model's token.
    same = (fp32_choices == int8_choices).float().mean().item()
    assert same >= 0.95, same


def test_quantized_checkpoint_round_trips_and_loads_from_the_cli(trained, tmp_path, capsys):
    model, tokenizer, _ = trained
    source = save_checkpoint(tmp_path / "fp32", model, tokenizer)
    before = (source / "model.safetensors").read_bytes()
    assert main(["quantize", "--checkpoint", str(source), "--out", str(source), "--overwrite"]) not in (0, None)
    assert "the checkpoint itself" in capsys.readouterr().err
    assert (source / "model.safetensors").read_bytes() == before  # the fp32 original is untouched
    assert main(["quantize", "--checkpoint", str(source), "--out", str(tmp_path / "int8")]) == 0
    loaded, _, meta = load_checkpoint(tmp_path / "int8")
    assert meta["quantization"] == "int8"
    assert any(isinstance(m, Int8Linear) for m in loaded.modules())
    expected = TransformerLM(model.config)
    expected.load_state_dict(model.state_dict())
    quantize_int8(expected.eval())
    tokens = torch.tensor([tokenizer.encode("To be, or not")])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), expected(tokens))  # the same int8 weights, read back exactly
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "int8"), "--prompt", "ROMEO:", "--max-new-tokens", "5",
                 "--temperature", "0"]) in (0, None)
    assert capsys.readouterr().out.startswith("ROMEO:")

"""MFU's FLOP count against hand counts: GPT-2 small (tied, biases, 4d MLP) and llama-tiny (grouped
K/V heads, a gated MLP, an untied unembedding), at full context and a shorter sequence."""

from __future__ import annotations

import pytest

from glasslm.presets import get_preset
from glasslm.training.flops import matmul_parameters, mfu, peak_flops, training_flops_per_token


def test_gpt2_small_by_hand():
    d, layers, vocab, seq = 768, 12, 50257, 1024
    block = 4 * d * d + 2 * d * 4 * d  # q, k, v, out; the MLP's two matrices (biases are not multiplied)
    n = layers * block + vocab * d  # tied: the embedding table is the unembedding's matrix
    assert matmul_parameters(get_preset("gpt2-small")) == n
    assert training_flops_per_token(get_preset("gpt2-small")) == 6 * n + 12 * layers * d * seq
    assert training_flops_per_token(get_preset("gpt2-small"), seq_len=256) == 6 * n + 12 * layers * d * 256


def test_llama_tiny_by_hand():
    d, layers, heads, kv_heads, d_mlp, vocab, seq = 128, 4, 8, 2, 344, 512, 256
    head = d // heads
    block = d * heads * head + 2 * d * kv_heads * head + heads * head * d + 3 * d * d_mlp  # q; k, v; out; gate, up, down
    n = layers * block + vocab * d  # the unembedding (untied); the embedding table is a look-up
    assert matmul_parameters(get_preset("llama-tiny")) == n
    assert training_flops_per_token(get_preset("llama-tiny")) == 6 * n + 12 * layers * heads * head * seq


def test_mfu_and_peaks():
    assert mfu(tokens_per_second=1000.0, flops_per_token=2e9, peak_flops=4e12) == pytest.approx(0.5)
    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None

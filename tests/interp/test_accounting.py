"""Parameter and FLOP accounting, checked against figures worked out by hand from the architecture."""

from __future__ import annotations

import pytest

from glasslm.interp.accounting import (
    ATTENTION_MIXING,
    cost_table,
    forward_flops_per_token,
    parameter_count,
    training_flops_per_token,
)
from glasslm.cli import main
from glasslm.presets import get_preset

GPT2_VOCAB = 50257


def gpt2_by_hand(d: int, layers: int, context: int) -> tuple[int, int]:
    """(parameters, forward FLOPs per token) of a GPT-2 from its formulae.

    Per layer: qkv d x 3d (+3d bias), out d x d (+d), MLP d x 4d (+4d) and 4d x d (+d), two
    LayerNorms (2d each): 12d^2 + 13d. Plus token and position tables and the final LayerNorm.
    FLOPs: 2 per weight of every matmul (12d^2 per layer), q.k^T and pattern.v over the full
    context (2 x 2 x context x d per layer), and the tied unembedding (2 d vocab).
    """
    params = GPT2_VOCAB * d + context * d + layers * (12 * d * d + 13 * d) + 2 * d
    flops = layers * 2 * 12 * d * d + layers * 2 * 2 * context * d + 2 * d * GPT2_VOCAB
    return params, flops


@pytest.mark.parametrize("preset, d, layers, expected_params", [
    ("gpt2-small", 768, 12, 124_439_808),
    ("gpt2-xl", 1600, 48, 1_557_611_200),
])
def test_gpt2_totals_match_hand_computed_figures(preset, d, layers, expected_params):
    params, flops = gpt2_by_hand(d, layers, context=1024)
    assert params == expected_params  # the formula agrees with the published counts
    cfg = get_preset(preset)
    assert parameter_count(cfg) == expected_params
    assert forward_flops_per_token(cfg) == flops
    assert training_flops_per_token(cfg) == 3 * flops


def test_gpt2_small_figures_written_out():
    # 2 x 12 layers x 12 x 768^2 = 169,869,312; attention 4 x 12 x 1024 x 768 = 37,748,736;
    # unembedding 2 x 768 x 50257 = 77,194,752.
    assert forward_flops_per_token(get_preset("gpt2-small")) == 169_869_312 + 37_748_736 + 77_194_752
    # A shorter context changes only the attention term (and the position table's size).
    assert forward_flops_per_token(get_preset("gpt2-small", context_length=256)) == (
        169_869_312 + 37_748_736 // 4 + 77_194_752
    )


def test_llama_with_gqa_and_untied_unembedding_by_component():
    cfg = get_preset("llama-tiny")  # d 128, 4 layers, 8 heads, 2 kv heads, d_head 16, d_mlp 344, vocab 512
    d, layers, d_head, vocab, context = 128, 4, 16, 512, 256
    rows = {row.name: row for row in cost_table(cfg)}
    qkv_out = d * (8 + 2 * 2) * d_head + d * d
    assert rows["blocks.*.attn"].parameters == layers * qkv_out
    assert rows["blocks.*.attn"].forward_flops_per_token == 2 * layers * qkv_out
    assert rows["blocks.*.mlp"].forward_flops_per_token == 2 * layers * 3 * d * 344
    assert rows[ATTENTION_MIXING].forward_flops_per_token == 4 * layers * context * 8 * d_head
    assert rows["unembed"].parameters == vocab * d
    assert rows["unembed"].forward_flops_per_token == 2 * vocab * d
    assert rows["embed"].forward_flops_per_token == 0
    assert sum(row.parameters for row in rows.values()) == parameter_count(cfg)


def test_info_command_prints_components_and_totals(capsys):
    assert main(["info", "--preset", "gpt2-small", "--context-length", "1024"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out
    assert f"{169_869_312 + 37_748_736 + 77_194_752:,}" in out
    assert "unembed (tied to embed)" in out and "training FLOPs per token" in out

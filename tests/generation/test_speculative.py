"""Speculative decoding: exactly the target's greedy tokens, whatever the draft proposes."""

from __future__ import annotations

import pytest
import torch

from glasslm.presets import get_preset
from glasslm.generation import generate_tokens
from glasslm.core.model import TransformerLM
from glasslm.generation.speculative import SpeculativeStats, speculative_tokens


def _model(seed: int, **overrides) -> TransformerLM:
    torch.manual_seed(seed)
    # A larger init makes logits peaked, so greedy choices are far from ties and comparisons are sharp.
    settings = {"vocab_size": 64, "init_std": 0.2, **overrides}
    return TransformerLM(get_preset("llama-tiny", **settings)).eval()


@pytest.mark.parametrize("lookahead", [1, 3, 6])
def test_output_equals_the_target_alone_with_an_unrelated_draft(lookahead):
    target, draft = _model(0), _model(1, n_layers=1, d_model=64, n_heads=2, n_kv_heads=2)
    prompt = [5, 9, 2, 33]
    stats = SpeculativeStats()
    got = list(speculative_tokens(target, draft, prompt, max_new_tokens=40, lookahead=lookahead, stats=stats))
    assert got == list(generate_tokens(target, prompt, max_new_tokens=40, temperature=0.0))
    assert stats.tokens == 40 and stats.target_passes <= 40


def test_a_perfect_draft_is_always_accepted():
    target = _model(0)
    stats = SpeculativeStats()
    got = list(speculative_tokens(target, target, [1, 2, 3], max_new_tokens=30, lookahead=4, stats=stats))
    assert got == list(generate_tokens(target, [1, 2, 3], max_new_tokens=30, temperature=0.0))
    assert stats.acceptance_rate == 1.0
    assert stats.target_passes == 6  # 5 tokens per pass: 4 accepted proposals + the target's own


def test_stop_tokens_and_bad_inputs():
    target, draft = _model(0), _model(1, n_layers=1)
    alone = list(generate_tokens(target, [1, 2], max_new_tokens=20, temperature=0.0))
    stop = alone[7]
    got = list(speculative_tokens(target, draft, [1, 2], max_new_tokens=20, stop_tokens=[stop]))
    assert got == list(generate_tokens(target, [1, 2], max_new_tokens=20, temperature=0.0, stop_tokens=[stop]))
    assert got == alone[:alone.index(stop)]
    with pytest.raises(ValueError, match="vocabulary"):
        list(speculative_tokens(target, _model(2, vocab_size=65), [1], max_new_tokens=3))
    with pytest.raises(ValueError, match="context length"):
        list(speculative_tokens(target, draft, [1], max_new_tokens=target.config.context_length))

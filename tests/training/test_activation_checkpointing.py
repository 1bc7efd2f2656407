"""Activation checkpointing (--activation-checkpointing): each block really recomputes in backward,
the gradients are bit-equal to the plain run's (perturbed weights, float32; with dropout too, since
the recomputation replays the saved RNG state), a training run's losses are identical, and the
model's parameter names (so its checkpoints) are unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.presets import get_preset
from glasslm.training.activations import checkpoint_blocks
from glasslm.training.config import TrainConfig
from glasslm.training.loop import train
from seed_models import randomize_

TINY = dict(vocab_size=32, n_layers=3, context_length=16)


def perturbed(preset: str, **overrides) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(get_preset(preset, **{**TINY, **overrides}))
    with torch.no_grad():  # trained-like weights: every matrix moved away from its initialisation
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return randomize_(model)


def gradients(model: TransformerLM, x: torch.Tensor, y: torch.Tensor, seed: int = 1) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both runs
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("preset,dropout", [("shakespeare-char-cpu", 0.0), ("llama-tiny", 0.0),
                                            ("gpt2-small", 0.0), ("shakespeare-char-cpu", 0.2)])
def test_gradients_are_bit_equal_to_the_plain_run(preset, dropout):
    overrides = dict(d_model=32, n_heads=4) if preset != "shakespeare-char-cpu" else {}
    if preset == "llama-tiny":
        overrides["n_kv_heads"] = 2
    plain = perturbed(preset, dropout=dropout, **overrides).train()
    checkpointed = copy.deepcopy(plain)
    assert checkpoint_blocks(checkpointed) == 3
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 32, (2, 4, 16), generator=g)
    expected, got = gradients(plain, x, y), gradients(checkpointed, x, y)
    assert list(got) == list(expected) == [n for n, _ in plain.named_parameters()]
    assert any(g.abs().sum() > 0 for g in expected.values())
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_each_block_runs_its_forward_again_in_backward():
    model = perturbed("shakespeare-char-cpu").train()
    calls = []
    for block in model.blocks:
        block.attn.register_forward_hook(lambda *_: calls.append(1))
    x, y = torch.randint(0, 32, (2, 2, 16))
    gradients(model, x, y)
    assert len(calls) == 3, "plain: one attention forward per block"
    checkpoint_blocks(model)
    calls.clear()
    gradients(model, x, y)
    assert len(calls) == 6, "checkpointed: each block's attention runs again inside backward"
    calls.clear()
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert len(calls) == 6, "without grad or in eval mode the block runs once, as before"


def test_training_run_is_identical_and_its_checkpoint_loads_plainly(tmp_path):
    torch.set_num_threads(1)
    tokens = torch.randint(0, 32, (3000,), generator=torch.Generator().manual_seed(0))
    model_cfg = get_preset("shakespeare-char-cpu", **TINY)

    def run(checkpointing: bool, out: str):
        cfg = TrainConfig(max_steps=4, batch_size=4, warmup_steps=1, eval_interval=0, eval_iters=1, log_interval=1,
                          progress=False, activation_checkpointing=checkpointing, muon_ns_dtype="float32")
        return train(model_cfg, cfg, tokens[:2500], tokens[2500:], run_dir=tmp_path / out)

    plain, checkpointed = run(False, "plain"), run(True, "ac")
    assert checkpointed.train_losses == plain.train_losses
    assert checkpointed.val_losses == plain.val_losses
    from glasslm.io.checkpoint import load_checkpoint

    loaded, _, _ = load_checkpoint(tmp_path / "ac")
    for (name, a), (_, b) in zip(loaded.state_dict().items(), plain.model.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.usefixtures("unchecked_shapes")  # beartype's checks are not traceable by dynamo
def test_compiled_training_with_activation_checkpointing_matches_compiled_plain():
    torch.set_num_threads(1)
    tokens = torch.randint(0, 32, (3000,), generator=torch.Generator().manual_seed(0))
    model_cfg = get_preset("shakespeare-char-cpu", **TINY)

    def run(checkpointing: bool):
        cfg = TrainConfig(max_steps=3, batch_size=4, warmup_steps=1, eval_interval=0, eval_iters=1, log_interval=1,
                          progress=False, compile=True, activation_checkpointing=checkpointing,
                          muon_ns_dtype="float32")
        return train(model_cfg, cfg, tokens[:2500], tokens[2500:]).train_losses

    assert run(True) == pytest.approx(run(False), rel=1e-5)

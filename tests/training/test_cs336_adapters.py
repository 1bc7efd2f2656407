"""Stanford CS336 assignment 1's adapter interface, met by public glasslm functions with no glue.

Each `run_*` / `get_*` below is what a student would write in `tests/adapters.py`: one call into
glasslm, no conversion. The tests check them against independent references (torch's own
optimizer, clipping and losses, a complex-number RoPE, the closed-form schedule).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from glasslm.tokenizers.trainer import train_bpe
from glasslm.data import get_batch
from glasslm.core.layers import cross_entropy
from glasslm.training.optim import AdamW, clip_grad_norm, cosine_schedule
from glasslm.core.positions import RotaryPositions
from glasslm.io.state import load_checkpoint, save_checkpoint
from glasslm.tokenizers import BPETokenizer


# ----- the adapters: each one line -----

def run_get_batch(dataset, batch_size, context_length, device):
    return get_batch(dataset, batch_size, context_length, device)


def run_gradient_clipping(parameters, max_l2_norm):
    clip_grad_norm(parameters, max_l2_norm)


def get_adamw_cls():
    return AdamW


def run_get_lr_cosine_schedule(it, max_learning_rate, min_learning_rate, warmup_iters, cosine_cycle_iters):
    return cosine_schedule(it, max_learning_rate, min_learning_rate, warmup_iters, cosine_cycle_iters)


def run_save_checkpoint(model, optimizer, iteration, out):
    save_checkpoint(model, optimizer, iteration, out)


def run_load_checkpoint(src, model, optimizer):
    return load_checkpoint(src, model, optimizer)


def run_train_bpe(input_path, vocab_size, special_tokens, **kwargs):
    return train_bpe(input_path, vocab_size, special_tokens)


def get_tokenizer(vocab, merges, special_tokens=None):
    return BPETokenizer(vocab, merges, special_tokens)


def run_rope(d_k, theta, max_seq_len, in_query_or_key, token_positions):
    return RotaryPositions(max_seq_len, d_k, theta)(in_query_or_key, token_positions)


def run_cross_entropy(inputs, targets):
    return cross_entropy(inputs, targets)


# ----- the checks -----

def test_get_batch_on_a_numpy_array_and_memmap(tmp_path):
    data = np.arange(1000, dtype=np.uint16)
    x, y = run_get_batch(data, 32, 7, "cpu")
    assert x.shape == y.shape == (32, 7) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1) and x.min() >= 0 and x[:, 0].max() <= 1000 - 8 and y.max() <= 999
    starts = torch.cat([run_get_batch(data, 64, 7, "cpu")[0][:, 0] for _ in range(50)])
    assert starts.min() < 50 and starts.max() > 1000 - 8 - 50, "every start is drawn, including the ends"
    data.tofile(tmp_path / "tokens.bin")
    mapped = np.memmap(tmp_path / "tokens.bin", dtype=np.uint16, mode="r")
    x, y = get_batch(mapped, 4, 7, "cpu", generator=torch.Generator().manual_seed(0))
    assert torch.equal(y, x + 1)
    with pytest.raises(TypeError, match="generator="):
        get_batch(data, 4, 7, torch.Generator())


def test_gradient_clipping_equals_torch():
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 4), (4,), (3, 5)]
    ours = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, ref):
        a.grad = torch.randn(a.shape, generator=g) * 3
        b.grad = a.grad.clone()
    ours[1].grad = ref[1].grad = None  # frozen: skipped
    run_gradient_clipping(ours, 1.0)
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    for a, b in zip(ours, ref):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_adamw_cls_built_like_torch_matches_torch():
    torch.manual_seed(0)
    model, ref = nn.Linear(6, 3), nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    kw = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    opt, ref_opt = get_adamw_cls()(model.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
    x = torch.randn(200, 6, generator=torch.Generator().manual_seed(1))
    for i in range(1000):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            ((m(x[i % 200:i % 200 + 8]) - 1) ** 2).mean().backward()
            o.step()
    assert (model.weight - ref.weight).abs().max().item() <= 1e-6


def test_cosine_schedule_as_cs336_states_it():
    max_lr, min_lr, warmup, cycle = 1.0, 0.1, 7, 21
    for it in range(25):
        if it < warmup:
            expected = it / warmup * max_lr
        elif it <= cycle:
            expected = min_lr + 0.5 * (1 + math.cos((it - warmup) / (cycle - warmup) * math.pi)) * (max_lr - min_lr)
        else:
            expected = min_lr
        assert run_get_lr_cosine_schedule(it, max_lr, min_lr, warmup, cycle) == pytest.approx(expected)


def test_checkpoint_round_trip_through_path_and_file_object(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    for out in (tmp_path / "ckpt.safetensors", io.BytesIO()):
        run_save_checkpoint(model, opt, 3, out)
        fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        fresh_opt = AdamW(fresh.parameters(), lr=1e-2)
        if isinstance(out, io.BytesIO):
            out.seek(0)
        assert run_load_checkpoint(out, fresh, fresh_opt) == 3
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
        # Both continue identically: the optimizer's moments and step came back too.
        for m, o in ((model, opt), (fresh, fresh_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert (tmp_path / "ckpt.safetensors").read_bytes()[8:9] == b"{", "safetensors, not a pickle"


def test_train_bpe_reads_a_str_path(tmp_path):
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), size=rng.integers(2, 7))) for _ in range(400)]
    corpus.write_text(" ".join(rng.choice(words, size=6000)) + "<|endoftext|>low lower", encoding="utf-8")
    vocab, merges = run_train_bpe(str(corpus), 500, ["<|endoftext|>"])
    assert len(vocab) == 500 and len(merges) == 500 - 256 - 1
    assert (vocab, merges) == train_bpe(path=corpus, vocab_size=500, special_tokens=["<|endoftext|>"])
    assert (vocab, merges) == train_bpe(text=corpus.read_text(encoding="utf-8"), vocab_size=500,
                                        special_tokens=["<|endoftext|>"])
    tok = get_tokenizer(vocab, merges, ["<|endoftext|>"])
    assert tok.decode(tok.encode("low lower<|endoftext|>")) == "low lower<|endoftext|>"


def test_train_bpe_refuses_a_missing_path_and_ambiguous_arguments(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="pass text="):
        train_bpe(missing, 300)
    with pytest.raises(FileNotFoundError):
        train_bpe(path=missing, vocab_size=300)
    with pytest.raises(TypeError, match="exactly one"):
        train_bpe("abc", 300, text="abc")
    # Spelled out, the same string is text (its characters are the corpus).
    vocab, _ = train_bpe(text=missing, vocab_size=260)
    assert len(vocab) == 260


def _rope_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex multiplication: pair (x[2i], x[2i+1]) is a number rotated by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[..., None] * freqs  # (..., seq, d/2)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).reshape(x.shape).float()


def test_rope_per_row_positions_on_three_and_four_dim_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 12, 64, generator=g)
    positions = torch.randint(0, 30, (4, 12), generator=g)
    out = run_rope(64, 10000.0, 32, x, positions)
    assert out.shape == (4, 12, 64)
    torch.testing.assert_close(out, _rope_complex(x, positions, 10000.0), rtol=1e-5, atol=1e-5)
    shared = torch.arange(12)
    torch.testing.assert_close(run_rope(64, 500.0, 32, x, shared), _rope_complex(x, shared.expand(4, 12), 500.0),
                               rtol=1e-5, atol=1e-5)
    heads = torch.randn(4, 3, 12, 64, generator=g)
    torch.testing.assert_close(run_rope(64, 10000.0, 32, heads, positions),
                               _rope_complex(heads, positions[:, None, :], 10000.0), rtol=1e-5, atol=1e-5)


def test_cross_entropy_is_stable_for_huge_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5, 50, generator=g) * 1000
    targets = torch.randint(0, 50, (8, 5), generator=g)
    expected = -torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None]).mean()
    for impl in ("fast", "readable"):
        loss = cross_entropy(logits, targets, impl=impl)
        assert torch.isfinite(loss)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert run_cross_entropy(logits[0], targets[0]).item() == pytest.approx(
        -torch.log_softmax(logits[0].double(), -1).gather(-1, targets[0, :, None]).mean().item(), rel=1e-5)

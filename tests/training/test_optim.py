"""The written-out optimizers against torch's, clipping against torch's, and the schedule's closed form."""

import copy
import math

import pytest
import torch
from torch import nn

from glasslm.presets import get_preset
from glasslm.core.model import TransformerLM
from glasslm.training.optim import (
    AdamW, Muon, clip_grad_norm, cosine_schedule, make_optimizer, muon_param_groups, newton_schulz,
)
from glasslm.training.config import TrainConfig


def _params(seed: int, shapes=((6, 5), (5,), (3, 7))) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(opt_params: list[nn.Parameter], opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    """`steps` steps on a fixed random quadratic-plus-quartic loss (gradients change every step)."""
    g = torch.Generator().manual_seed(seed)
    targets = [torch.randn(p.shape, generator=g) for p in opt_params]
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(((p - t) ** 2).sum() + 0.1 * (p ** 4).sum() for p, t in zip(opt_params, targets))
        loss.backward()
        opt.step()


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_equals_torch_for_1000_steps(foreach):
    ours, ref = _params(0), _params(0)
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    _run(ours, AdamW(ours, **kw), 1000)
    _run(ref, torch.optim.AdamW(ref, foreach=foreach, **kw), 1000)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    assert diff <= 1e-6
    assert not torch.equal(ours[0], _params(0)[0]), "the parameters moved"


def test_adamw_matches_fused_and_param_groups():
    ours, ref = _params(1), _params(1)
    groups = lambda ps: [{"params": ps[:1], "weight_decay": 0.0}, {"params": ps[1:], "lr": 1e-2}]  # noqa: E731
    _run(ours, AdamW(groups(ours), lr=1e-3, weight_decay=0.05), 1000)
    _run(ref, torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.05, fused=True), 1000)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) <= 1e-6


def test_muon_equals_torch_muon_for_1000_steps():
    shapes = ((16, 8), (8, 24))  # tall and wide: the tall one is transposed, and its lr scaled
    ours, ref = _params(2, shapes), _params(2, shapes)
    _run(ours, Muon(ours, lr=0.01, momentum=0.9, weight_decay=0.01), 1000)
    _run(ref, torch.optim.Muon(ref, lr=0.01, momentum=0.9, weight_decay=0.01), 1000)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) <= 1e-6


def test_muon_adamw_groups_equal_torch_adamw_and_fused_path_equals_readable():
    shapes = ((16, 8), (8,), (10, 8))
    readable, fused, ref = _params(3, shapes), _params(3, shapes), _params(3, shapes)

    def groups(ps):
        return [dict(params=ps[:1], use_muon=True),
                dict(params=ps[1:], use_muon=False, lr=2e-3, weight_decay=0.1, betas=(0.8, 0.95))]
    _run(readable, Muon(groups(readable), lr=0.02), 300)
    _run(fused, Muon(groups(fused), lr=0.02, fused=True), 300)
    ref_opts = [torch.optim.Muon(ref[:1], lr=0.02, weight_decay=0.0),
                torch.optim.AdamW(ref[1:], lr=2e-3, weight_decay=0.1, betas=(0.8, 0.95), foreach=False)]

    class Both:
        def zero_grad(self):
            [o.zero_grad() for o in ref_opts]

        def step(self):
            [o.step() for o in ref_opts]
    _run(ref, Both(), 300)
    for a, b, c in zip(readable, fused, ref):
        assert (a - c).abs().max().item() <= 1e-6
        assert (a - b).abs().max().item() <= 1e-6


def test_muon_refuses_vectors_outside_adamw_groups():
    with pytest.raises(ValueError, match="use_muon=False"):
        Muon([nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize("cls,kw", [(AdamW, {}), (Muon, {"ns_dtype": "float32"})])
def test_state_dict_round_trip_continues_identically(cls, kw):
    shapes = ((6, 5), (4, 6))
    a, b = _params(4, shapes), _params(4, shapes)
    opt_a = cls(a, lr=1e-2, **kw)
    _run(a, opt_a, 5)
    b_values = [p.detach().clone() for p in a]
    opt_b = cls(b, lr=1e-2, **kw)
    with torch.no_grad():
        for p, v in zip(b, b_values):
            p.copy_(v)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as if read back from a file
    _run(a, opt_a, 5, seed=9)
    _run(b, opt_b, 5, seed=9)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_adamw_state_loads_into_torch_adamw():
    a, b = _params(5), _params(5)
    ours = AdamW(a, lr=1e-2)
    _run(a, ours, 3)
    ref = torch.optim.AdamW(b, lr=1e-2, foreach=False)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    _run(a, ours, 3, seed=1)
    _run(b, ref, 3, seed=1)
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-6


def test_make_optimizer_follows_impl_and_splits_muon_groups():
    tiny = dict(vocab_size=11, n_layers=2, context_length=8)
    fast = TransformerLM(get_preset("llama-tiny", **tiny))
    readable = TransformerLM(get_preset("llama-tiny", impl="readable", **tiny))
    assert type(make_optimizer(fast, TrainConfig())) is torch.optim.AdamW
    assert type(make_optimizer(readable, TrainConfig())) is AdamW
    opt = make_optimizer(readable, TrainConfig(optimizer="muon", muon_lr=0.03, lr=1e-3))
    assert isinstance(opt, Muon) and not opt.fused and make_optimizer(fast, TrainConfig(optimizer="muon")).fused
    names = {id(p): n for n, p in readable.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    adam = {names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
    assert muon == {n for n, p in readable.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    assert {"embed.weight", "unembed.weight"} <= adam and muon | adam == set(names.values())
    assert {g["initial_lr"] for g in opt.param_groups if g["use_muon"]} == {0.03}
    assert len(muon_param_groups(readable, 0.02, 1e-3, 0.1)) == 3


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "fma"}, "float32"),               # AMD Zen 3: bfloat16 matmuls are emulated
    ({"avx512f", "avx512_vnni"}, "float32"),    # Intel Xeon without bf16 units
    ({"avx512f", "avx512_bf16"}, "bfloat16"),   # AMD Zen 4
    ({"amx_bf16", "amx_tile"}, "bfloat16"),     # Sapphire Rapids
])
def test_auto_newton_schulz_precision_is_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch, flags, expected):
    from glasslm import runtime

    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset(flags))
    model = TransformerLM(get_preset("llama-tiny", vocab_size=11, n_layers=1, context_length=8))
    chosen = {g["ns_dtype"] for g in make_optimizer(model, TrainConfig(optimizer="muon")).param_groups}
    assert chosen == {expected}
    for given in ("bfloat16", "float32"):  # a stated precision is kept on any CPU
        stated = make_optimizer(model, TrainConfig(optimizer="muon", muon_ns_dtype=given))
        assert {g["ns_dtype"] for g in stated.param_groups} == {given}
    with pytest.raises(ValueError, match="muon_ns_dtype must be 'auto', 'bfloat16' or 'float32'"):
        TrainConfig(muon_ns_dtype="float16")


def test_clip_grad_norm_equals_torch_and_skips_params_without_grad():
    for max_norm in (0.5, 1e9):
        ours, ref = _params(6), _params(6)
        extra_ours, extra_ref = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))  # no grad
        for ps in (ours, ref):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, float(i + 1))
        n_ours = clip_grad_norm(ours + [extra_ours], max_norm)
        n_ref = torch.nn.utils.clip_grad_norm_(ref + [extra_ref], max_norm)
        assert n_ours.item() == pytest.approx(n_ref.item(), rel=1e-6)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert clip_grad_norm([nn.Parameter(torch.ones(1))], 1.0).item() == 0.0


def test_cosine_schedule_boundaries_follow_the_closed_form():
    lr, min_lr, warmup, end = 1.0, 0.1, 10, 110
    assert cosine_schedule(0, lr, min_lr, warmup, end) == 0.0
    assert cosine_schedule(5, lr, min_lr, warmup, end) == pytest.approx(0.5)
    assert cosine_schedule(warmup, lr, min_lr, warmup, end) == pytest.approx(lr)
    mid = (warmup + end) // 2
    assert cosine_schedule(mid, lr, min_lr, warmup, end) == pytest.approx((lr + min_lr) / 2)
    assert cosine_schedule(35, lr, min_lr, warmup, end) == pytest.approx(
        min_lr + 0.5 * (1 + math.cos(math.pi * 25 / 100)) * (lr - min_lr))
    assert cosine_schedule(end, lr, min_lr, warmup, end) == pytest.approx(min_lr)
    assert cosine_schedule(end + 50, lr, min_lr, warmup, end) == min_lr
    assert cosine_schedule(0, lr, min_lr, 0, end) == lr  # no warmup: the cosine starts at the peak


def test_batched_newton_schulz_equals_one_matrix_at_a_time():
    g = torch.Generator().manual_seed(7)
    stack = torch.randn(3, 12, 5, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        batched = newton_schulz(stack, dtype=dtype).float()
        single = torch.stack([newton_schulz(m, dtype=dtype).float() for m in stack])
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: different kernels round differently
        torch.testing.assert_close(batched, single, atol=tol, rtol=0)


def test_fast_muon_batches_same_shaped_matrices_and_stays_close_to_readable():
    shapes = ((16, 8), (16, 8), (8, 16), (8,))
    readable, fast = _params(8, shapes), _params(8, shapes)

    def groups(ps):
        return [dict(params=ps[:3]), dict(params=ps[3:], use_muon=False)]
    _run(readable, Muon(groups(readable), lr=0.02, ns_dtype="float32"), 100)
    _run(fast, Muon(groups(fast), lr=0.02, ns_dtype="float32", fused=True), 100)
    assert max((a - b).abs().max().item() for a, b in zip(readable, fast)) <= 1e-4

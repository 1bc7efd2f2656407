"""Each from-scratch component against PyTorch's own ops, closed forms and gradcheck."""

import math

import pytest
import torch
import torch.nn.functional as F

from glasslm.core.attention import CausalSelfAttention, causal_mask, scaled_dot_product_attention, softmax
from glasslm.core.layers import (
    MLP, Embedding, HookPoint, LayerNorm, Linear, RMSNorm, SwiGLU, activation, cross_entropy, dropout, gelu, gelu_tanh,
    linear, relu, silu,
)
from glasslm.core.positions import RotaryPositions, sinusoidal_table

IMPLS = ["readable", "fast"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_functional(impl, bias):
    norm = LayerNorm(16, eps=1e-5, bias=bias, impl=impl)
    with torch.no_grad():
        norm.weight.normal_()
        if bias:
            norm.bias.normal_()
    x = torch.randn(3, 5, 16) * 4 + 2
    expected = F.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5)
    torch.testing.assert_close(norm(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_of_known_vector(impl):
    norm = RMSNorm(2, eps=0.0 + 1e-12, impl=impl)
    out = norm(torch.tensor([[3.0, 4.0]]))
    rms = math.sqrt((9 + 16) / 2)
    torch.testing.assert_close(out, torch.tensor([[3 / rms, 4 / rms]]))


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_computes_in_float32_for_bf16(impl):
    norm = RMSNorm(64, eps=1e-6, impl=impl)
    x = (torch.randn(4, 64) * 100).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    # Only the final rounding to bf16 may differ: well within one bf16 ulp at |values| <= ~4.
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "name, reference",
    [
        ("gelu", F.gelu),
        ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
        ("relu", F.relu),
        ("silu", F.silu),
    ],
)
@pytest.mark.parametrize("impl", IMPLS)
def test_activations_match_functional(name, reference, impl):
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    torch.testing.assert_close(activation(name, impl)(x), reference(x))


def test_gelu_closed_form_values():
    # GELU(1) = Phi(1) = 0.8413447460685429...
    assert gelu(torch.tensor(1.0, dtype=torch.float64)).item() == pytest.approx(0.8413447460685429, abs=1e-12)
    assert relu(torch.tensor(-3.0)).item() == 0.0
    assert silu(torch.tensor(0.0)).item() == 0.0


def test_softmax_matches_torch_and_is_stable():
    x = torch.randn(4, 7, dtype=torch.float64) * 10
    torch.testing.assert_close(softmax(x, dim=-1), torch.softmax(x, dim=-1))
    huge = torch.tensor([[1e30, 1e30 - 1e24, -1e30], [3e38, 0.0, -3e38]])
    out = softmax(huge, dim=-1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(2))


def test_softmax_fully_masked_row_is_zero_not_nan():
    x = torch.tensor([[float("-inf")] * 3, [0.0, float("-inf"), 0.0]])
    out = softmax(x, dim=-1)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.5]]))


def test_embedding_matches_functional():
    emb = Embedding(11, 6)
    tokens = torch.randint(0, 11, (3, 4))
    torch.testing.assert_close(emb(tokens), F.embedding(tokens, emb.weight))


def test_linear_matches_matmul():
    lin = Linear(5, 3, bias=True)
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(2, 4, 5)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)


def test_sinusoidal_table_closed_form():
    d_model = 8
    table = sinusoidal_table(50, d_model)
    for pos in (0, 1, 7, 49):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, d, theta, gain", [(131_072, 64, 500_000.0, 1.0), (4_099, 24, 10_000.0, 1.2),
                                                   (70_001, 128, 1e6, 1.0), (5, 6, 10_000.0, 0.7)])
def test_the_rotary_table_is_the_one_pass_formula_bit_for_bit(rows, d, theta, gain, threads):
    """The table made a stretch of rows at a time (`rotary_table`) holds exactly the float32 values
    of the formula in one pass: (gain * cos(p * inv_freq)).float() in float64, a 128k context included."""
    from glasslm.core.positions import rotary_table

    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cos, sin = rotary_table(rows, inv_freq, gain)
        angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq
        assert cos.dtype == sin.dtype == torch.float32
        assert torch.equal(cos, (gain * torch.cos(angles)).float())
        assert torch.equal(sin, (gain * torch.sin(angles)).float())
    finally:
        torch.set_num_threads(before)


def test_rope_preserves_norms():
    rope = RotaryPositions(32, 16, theta=10000.0)
    x = torch.randn(2, 3, 32, 16)
    rotated = rope(x, torch.arange(32))
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    # Position 0 is the identity rotation.
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rope_fast_complex_path_equals_the_written_out_rotation(dtype):
    readable, fast = RotaryPositions(32, 16, theta=500.0), RotaryPositions(32, 16, theta=500.0, impl="fast")
    # As attention feeds it: q sliced out of a fused projection, heads transposed (a strided view),
    # at an odd offset into its storage, and per-row positions of a left-padded batch.
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(3, 20, 1 + 2 * 16, dtype=torch.float64, generator=generator)
    positions = torch.stack([torch.arange(20), torch.arange(20) + 5, torch.arange(20) + 12])
    plain = torch.randn(3, 2, 20, 16, dtype=torch.float64, generator=generator)
    for x in (fused[..., 1:].unflatten(-1, (2, 16)).transpose(1, 2), plain):
        x = x.to(dtype)
        x_r, x_f = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_r, out_f = readable(x_r, positions), fast(x_f, positions)
        assert out_f.dtype == dtype and out_f.shape == x.shape
        # Both paths compute in float32 (or float64) and round once at the end; a last-bit difference
        # there can flip one bf16 rounding, a relative 2^-8, so bf16 is compared relatively.
        tol = {torch.float32: dict(atol=1e-6, rtol=0), torch.float64: dict(atol=1e-12, rtol=0),
               torch.bfloat16: dict(atol=1e-5, rtol=2**-7)}[dtype]
        torch.testing.assert_close(out_f, out_r, **tol)
        weights = torch.randn(x.shape, dtype=torch.float64, generator=generator).to(dtype)
        (out_r * weights).sum().backward()
        (out_f * weights).sum().backward()
        torch.testing.assert_close(x_f.grad, x_r.grad, **{k: 4 * v for k, v in tol.items()})


def test_rope_dot_product_depends_only_on_offset():
    rope = RotaryPositions(64, 8, theta=500.0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)

    def score(pos_q: int, pos_k: int) -> float:
        rq = rope(q.float().view(1, 1, 1, 8), torch.tensor([pos_q]))
        rk = rope(k.float().view(1, 1, 1, 8), torch.tensor([pos_k]))
        return (rq * rk).sum().item()

    for offset in (0, 3, 17):
        base = score(offset, 0)
        for start in (5, 20, 40):
            assert score(start + offset, start) == pytest.approx(base, abs=1e-4)
    assert score(10, 0) != pytest.approx(score(3, 0), abs=1e-3)


def test_readable_attention_matches_sdpa_outputs_and_gradients():
    q, k, v = (torch.randn(2, 3, 10, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ours = scaled_dot_product_attention(q, k, v, causal_mask(10, 10))
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, theirs)
    grad_out = torch.randn_like(ours)
    grads_ours = torch.autograd.grad(ours, (q, k, v), grad_out)
    grads_theirs = torch.autograd.grad(theirs, (q, k, v), grad_out)
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("use_rope", [False, True])
def test_attention_module_readable_equals_fast(n_heads, n_kv_heads, use_rope):
    rope = RotaryPositions(16, 8) if use_rope else None
    fast = CausalSelfAttention(32, n_heads, n_kv_heads, bias=True, dropout_p=0.0, impl="fast", rotary=rope)
    readable = CausalSelfAttention(32, n_heads, n_kv_heads, bias=True, dropout_p=0.0, impl="readable", rotary=rope)
    readable.load_state_dict(fast.state_dict())
    x = torch.randn(2, 16, 32, requires_grad=True)
    out_fast = fast(x, torch.arange(16))
    out_readable = readable(x, torch.arange(16))
    torch.testing.assert_close(out_fast, out_readable, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out_fast)
    out_fast.backward(g)
    out_readable.backward(g)
    for (name, p_fast), p_read in zip(fast.named_parameters(), readable.parameters()):
        torch.testing.assert_close(p_fast.grad, p_read.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gradcheck_small_components():
    opts = dict(dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 6, **opts)
    ln = LayerNorm(6, impl="readable").double()
    rms = RMSNorm(6, impl="readable").double()
    assert torch.autograd.gradcheck(lambda t: ln(t), (x,))
    assert torch.autograd.gradcheck(lambda t: rms(t), (x,))
    assert torch.autograd.gradcheck(lambda t: softmax(t, dim=-1), (x,))
    assert torch.autograd.gradcheck(gelu_tanh, (x,))
    assert torch.autograd.gradcheck(gelu, (x,))
    q, k, v = (torch.randn(1, 2, 4, 3, **opts) for _ in range(3))
    assert torch.autograd.gradcheck(
        lambda a, b, c: scaled_dot_product_attention(a, b, c, causal_mask(4, 4)), (q, k, v)
    )
    logits = torch.randn(5, 7, **opts)
    targets = torch.randint(0, 7, (5,))
    assert torch.autograd.gradcheck(lambda t: cross_entropy(t, targets, impl="readable"), (logits,))


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_matches_functional(impl):
    logits = torch.randn(3, 4, 9)
    targets = torch.randint(0, 9, (3, 4))
    targets[0, 1] = -100
    expected = F.cross_entropy(logits.view(-1, 9), targets.view(-1), ignore_index=-100)
    torch.testing.assert_close(cross_entropy(logits, targets, impl=impl), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_statistics(impl):
    x = torch.ones(200_000)
    assert dropout(x, 0.3, training=False, impl=impl) is x
    out = dropout(x, 0.3, training=True, impl=impl)
    zero_fraction = (out == 0).float().mean().item()
    assert zero_fraction == pytest.approx(0.3, abs=0.01)
    assert out.mean().item() == pytest.approx(1.0, abs=0.02)  # survivors scaled by 1/(1-p)


def test_mlp_and_swiglu_match_manual_formulas():
    x = torch.randn(2, 3, 8)
    mlp = MLP(8, 32, "gelu_tanh", bias=True, impl="readable")
    expected = F.linear(F.gelu(F.linear(x, mlp.up.weight, mlp.up.bias), approximate="tanh"), mlp.down.weight,
                        mlp.down.bias)
    torch.testing.assert_close(mlp(x), expected)
    swiglu = SwiGLU(8, 20, "silu", bias=False, impl="fast")
    expected = (F.silu(x @ swiglu.gate.weight.T) * (x @ swiglu.up.weight.T)) @ swiglu.down.weight.T
    torch.testing.assert_close(swiglu(x), expected)


def test_hook_point_skips_module_machinery_only_while_nothing_is_hooked():
    point, x = HookPoint(), torch.randn(3)
    assert point(x) is x  # unhooked: the input itself, no copy
    handle = point.register_forward_hook(lambda module, args, out: out * 2)
    assert torch.equal(point(x), x * 2)
    handle.remove()
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append(module))
    try:
        point(x)  # a hook on every module reaches hook points too
    finally:
        handle.remove()
    assert seen == [point]
    pre = point.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    assert torch.equal(point(x), x + 1)
    pre.remove()


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("d_out", [96, 97])  # 97: columns left over after the per-thread blocks
def test_one_row_across_threads_equals_f_linear(threads, d_out, monkeypatch):
    # The threaded one-row product (column-major weight, several threads, no grad) must give
    # F.linear's numbers, whatever the row's leading shape and with or without a bias.
    import glasslm.core.layers as layers

    calls = []
    threaded = layers._row_across_threads
    monkeypatch.setattr(layers, "_row_across_threads", lambda *args: calls.append(args[-1]) or threaded(*args))
    torch.manual_seed(0)
    weight = torch.randn(d_out, 64).T.contiguous().T  # column-major, as optimize_for_decoding lays it
    bias = torch.randn(d_out)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for shape in [(1, 64), (1, 1, 64), (64,)]:
                x = torch.randn(*shape)
                for b in (None, bias):
                    got = linear(x, weight, b)
                    assert got.shape == (*shape[:-1], d_out)
                    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
            assert calls == [threads] * 6  # every one-row case above took the threaded path
            # Several rows, a row-major weight, or grad mode take F.linear itself: bitwise equal.
            rows = torch.randn(3, 64)
            assert torch.equal(linear(rows, weight), F.linear(rows, weight))
            row_major = weight.contiguous()
            assert torch.equal(linear(x, row_major), F.linear(x, row_major))
        with torch.enable_grad():
            x = torch.randn(1, 64, requires_grad=True)
            assert torch.equal(linear(x, weight), F.linear(x, weight))
    finally:
        torch.set_num_threads(previous)

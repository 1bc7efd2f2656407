"""The mixture-of-experts layer (core/moe.py): routing against its closed form, the grouped fast path
against the token-by-token definition (outputs and gradients), the layer against transformers' Mixtral
and Qwen2-MoE blocks, and the auxiliary losses against transformers' load_balancing_loss_func."""

from __future__ import annotations

import pytest
import torch

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.core.moe import MoE, load_balancing_loss, route, router_z_loss


def perturbed_moe(d_shared=None, renormalize=True, n_experts=6, k=2, seed=0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(d_model=12, d_expert=20, n_experts=n_experts, k=k, renormalize=renormalize, d_shared=d_shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)  # large enough that routing differs token to token
    return moe


def test_route_is_top_k_of_the_softmax_renormalised_or_not():
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(3)) * 3
    probs = torch.softmax(logits, dim=-1)
    weights, experts = route(logits, 3, renormalize=False)
    expected = torch.sort(probs, dim=-1, descending=True)
    torch.testing.assert_close(weights, expected.values[:, :3])
    assert torch.equal(experts, expected.indices[:, :3])
    renormed, experts2 = route(logits, 3, renormalize=True)
    assert torch.equal(experts2, experts)
    # Renormalised weights are the softmax over the chosen logits alone.
    torch.testing.assert_close(renormed, torch.softmax(logits.gather(1, experts), dim=-1))


@pytest.mark.parametrize("d_shared", [None, 16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_the_token_by_token_definition_with_gradients(d_shared, renormalize):
    moe = perturbed_moe(d_shared, renormalize)
    x = torch.randn(3, 7, 12, generator=torch.Generator().manual_seed(1), requires_grad=True)
    results = {}
    for impl in ("readable", "fast"):
        moe.impl = impl
        moe.zero_grad()
        x.grad = None
        out = moe(x)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        results[impl] = (out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in moe.named_parameters()})
    (out_r, gx_r, g_r), (out_f, gx_f, g_f) = results["readable"], results["fast"]
    assert out_r.abs().max() > 0.1
    torch.testing.assert_close(out_f, out_r, rtol=1e-5, atol=1e-6)
    # A gradient element is a sum of terms as large as the tensor's largest (up to ~20 here), so its
    # float32 rounding scales with that, not with the element: on an AVX2 CPU the readable path itself
    # was 4e-6 from float64, and the two paths 2.6e-6 apart on an element of 0.06.
    torch.testing.assert_close(gx_f, gx_r, rtol=1e-5, atol=1e-6 * max(1.0, gx_r.abs().max().item()))
    for name in g_r:
        assert g_r[name].abs().max() > 0, name  # every weight gets a gradient here (all experts used)
        torch.testing.assert_close(g_f[name], g_r[name], rtol=1e-5, atol=1e-6 * max(1.0, g_r[name].abs().max().item()),
                                   msg=name)


def test_an_unused_expert_gets_no_gradient_and_is_not_read():
    moe = perturbed_moe(n_experts=6, k=1)
    x = torch.randn(1, 2, 12, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, experts = route(moe.router(x).reshape(2, -1), 1, True)
        unused = sorted(set(range(6)) - set(experts.flatten().tolist()))
        moe.gate[unused] = float("nan")  # a grouped pass never reads them: no NaN reaches the output
    out = moe(x)
    assert torch.isfinite(out).all()


def test_mixtral_and_qwen2_moe_blocks_of_transformers_compute_the_same():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    x = torch.randn(2, 9, 12, generator=torch.Generator().manual_seed(4))
    mixtral = MixtralSparseMoeBlock(transformers.MixtralConfig(hidden_size=12, intermediate_size=20,
                                                               num_local_experts=6, num_experts_per_tok=2)).eval()
    qwen = Qwen2MoeSparseMoeBlock(transformers.Qwen2MoeConfig(
        hidden_size=12, moe_intermediate_size=20, shared_expert_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False)).eval()
    for theirs, d_shared, renormalize in ((mixtral, None, True), (qwen, 16, False)):
        ours = perturbed_moe(d_shared, renormalize)
        with torch.no_grad():
            theirs.gate.weight.copy_(ours.router.weight)
            theirs.experts.gate_up_proj.copy_(torch.cat([ours.gate, ours.up], dim=1))  # (E, 2 d_expert, d_model)
            theirs.experts.down_proj.copy_(ours.down)
            if d_shared:
                for proj in ("gate", "up", "down"):
                    getattr(theirs.shared_expert, f"{proj}_proj").weight.copy_(getattr(ours.shared, proj).weight)
                theirs.shared_expert_gate.weight.copy_(ours.shared_gate.weight)
            expected = theirs(x)
            expected = expected[0] if isinstance(expected, tuple) else expected
        for impl in ("readable", "fast"):
            ours.impl = impl
            torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-6)


def test_load_balancing_loss_equals_transformers_and_its_closed_form():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(5)) * 2
    _, experts = route(logits, 2, True)
    ours = load_balancing_loss(logits, experts)
    torch.testing.assert_close(ours, load_balancing_loss_func((logits,), 8, 2))
    # Uniform routing probabilities and an even spread give the minimum, k.
    even = torch.arange(16).reshape(8, 2) % 8
    torch.testing.assert_close(load_balancing_loss(torch.zeros(8, 8), even), torch.tensor(2.0))
    torch.testing.assert_close(router_z_loss(logits), (logits.exp().sum(-1).log() ** 2).mean())


def moe_config(**changes) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=50, context_length=16, d_model=16, n_layers=3, n_heads=2, d_mlp=24,
                                 positional="rope", norm="rmsnorm", mlp="swiglu", activation="silu", bias=False,
                                 n_experts=4, experts_per_token=2, d_expert=8, moe_every=1,
                                 moe_z_loss_coef=1e-3), **changes})


def test_a_model_with_moe_layers_every_second_layer_and_its_router_losses():
    model = TransformerLM(moe_config(moe_every=2))
    kinds = [type(block.mlp).__name__ for block in model.blocks]
    assert kinds == ["SwiGLU", "MoE", "SwiGLU"]
    assert model.blocks[1].mlp.gate.shape == (4, 8, 16) and model.blocks[1].mlp.down.shape == (4, 16, 8)
    tokens = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    model.eval()
    model(tokens)
    assert model.router_losses() is None  # only training forwards record them
    model.train()
    model(tokens)
    losses = model.router_losses()
    moe = model.blocks[1].mlp
    logits = moe.router(model.blocks[1].ln2(torch.zeros(1, 1, 16))).shape  # (the router reads ln2's output)
    assert logits == (1, 1, 4)
    assert losses["load"].shape == (1, 4) and torch.isclose(losses["load"].sum(), torch.tensor(1.0))
    torch.testing.assert_close(losses["aux"], 0.01 * losses["balance"] + 1e-3 * losses["z"])
    losses["aux"].backward()
    assert moe.router.weight.grad.abs().max() > 0  # the aux loss trains the router


@pytest.mark.parametrize("changes, message", [
    (dict(mlp="mlp"), "needs mlp='swiglu'"),
    (dict(experts_per_token=5), "experts_per_token must be in [1, n_experts=4]"),
    (dict(moe_every=0), "moe_every must be a positive integer"),
    (dict(d_expert=0), "d_expert must be a positive integer or None"),
    (dict(n_experts=-1), "n_experts must be a non-negative integer"),
])
def test_bad_expert_settings_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        moe_config(**changes)


def test_accounting_charges_a_token_its_k_experts_and_counts_all_n():
    from glasslm.interp.accounting import forward_flops_per_token, parameter_count
    from glasslm.presets import get_preset

    dense, moe = get_preset("shakespeare-char-cpu"), get_preset("shakespeare-char-cpu-moe")
    assert moe.experts_per_token * moe.d_expert == dense.d_mlp  # the same active MLP width
    router = 2 * moe.n_experts * moe.d_model * moe.n_layers
    assert forward_flops_per_token(moe) == forward_flops_per_token(dense) + router
    experts = 3 * moe.n_experts * moe.d_expert * moe.d_model * moe.n_layers
    mlps = 3 * dense.d_mlp * dense.d_model * dense.n_layers
    assert parameter_count(moe) == parameter_count(dense) - mlps + experts + router // 2


def test_router_hooks_read_and_steer_the_routing():
    """blocks.{i}.mlp.hook_router_logits (batch, seq, n_experts) and hook_expert_weights (batch, seq, k), in
    TransformerLens's naming: the cache holds what the router computed, and a hook that raises one expert's
    logit sends every token there."""
    from glasslm.interp.hooks import run_with_cache, run_with_hooks

    torch.manual_seed(0)
    model = TransformerLM(moe_config(n_layers=2)).eval()
    tokens = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))
    names = ["blocks.1.mlp.hook_router_logits", "blocks.1.mlp.hook_expert_weights", "blocks.1.hook_resid_mid"]
    logits, cache = run_with_cache(model, tokens, names_filter=names)
    block = model.blocks[1]
    router_logits = block.mlp.router(block.ln2(cache["blocks.1.hook_resid_mid"]))
    torch.testing.assert_close(cache["blocks.1.mlp.hook_router_logits"], router_logits)
    expected, _ = route(router_logits.reshape(20, 4), 2, True)
    torch.testing.assert_close(cache["blocks.1.mlp.hook_expert_weights"], expected.reshape(2, 10, 2))
    torch.testing.assert_close(logits, model(tokens))  # caching changes nothing

    def to_expert_3(router_logits, hook):
        router_logits[..., 3] += 100.0
        return router_logits

    model.train()  # (records the routing statistics)
    steered = run_with_hooks(model, tokens, fwd_hooks=[("blocks.1.mlp.hook_router_logits", to_expert_3)])
    assert block.mlp.aux.load[3] == 0.5  # every token's first choice (k = 2: half of the assignments)
    assert not torch.allclose(steered, model(tokens))

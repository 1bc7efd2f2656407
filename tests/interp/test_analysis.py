"""The cache methods, new hook points, weight processing, patching and head scores, against closed forms."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.interp import weights
from glasslm.interp.attribution import (duplicate_token_score, head_logit_attribution, induction_score,
                                        previous_token_score, repeated_random_tokens)
from glasslm.interp.hooks import (run_with_cache, run_with_hooks, set_use_attn_in, set_use_attn_result,
                                  set_use_hook_mlp_in, set_use_split_qkv_input)
from glasslm.interp.patching import attribution_patching, patch_heads, patch_residual_stream
from glasslm.presets import get_preset

SHAPES = {"gpt2": ("gpt2-small", {}), "llama": ("llama-tiny", {"n_kv_heads": 2})}


def random_model(shape: str) -> TransformerLM:
    preset, extra = SHAPES[shape]
    torch.manual_seed(0)
    model = TransformerLM(get_preset(preset, n_layers=2, d_model=32, n_heads=4, vocab_size=50, context_length=16,
                                     **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.05))  # non-trivial gains and biases
    return model


TOKENS = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("shape", SHAPES)
def test_opt_in_hooks_leave_logits_unchanged_and_hold_what_they_say(shape):
    model = random_model(shape)
    with torch.no_grad():
        plain, cache = run_with_cache(model, TOKENS, names_filter=lambda n: n.endswith(("hook_z", "hook_attn_out")))
        for switch in (set_use_attn_result, set_use_split_qkv_input, set_use_hook_mlp_in):
            switch(model, True)
        logits, opt_in = run_with_cache(model, TOKENS)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    attn = model.blocks[0].attn
    result = opt_in["blocks.0.attn.hook_result"]  # (batch, seq, heads, d_model)
    bias = attn.out.bias if attn.out.bias is not None else 0
    torch.testing.assert_close(result.sum(2) + bias, cache["blocks.0.hook_attn_out"], atol=1e-5, rtol=1e-5)
    assert opt_in["blocks.1.hook_q_input"].shape == (2, 9, 4, 32)
    assert opt_in["blocks.1.hook_k_input"].shape == (2, 9, model.config.n_kv_heads, 32)
    torch.testing.assert_close(opt_in["blocks.1.hook_q_input"][:, :, 2], opt_in["blocks.1.hook_resid_pre"])
    torch.testing.assert_close(opt_in["blocks.0.hook_mlp_in"], opt_in["blocks.0.hook_resid_mid"])


@pytest.mark.parametrize("shape", SHAPES)
def test_hook_scale_is_the_norm_divisor_and_patching_it_changes_the_output(shape):
    model = random_model(shape)
    with torch.no_grad():
        _, cache = run_with_cache(model, TOKENS, names_filter=["blocks.1.hook_resid_pre", "blocks.1.ln1.hook_scale"])
        x = cache["blocks.1.hook_resid_pre"]
        if shape == "gpt2":
            x = x - x.mean(-1, keepdim=True)
        expected = (x.pow(2).mean(-1, keepdim=True) + model.blocks[1].ln1.eps).sqrt()
        torch.testing.assert_close(cache["blocks.1.ln1.hook_scale"], expected)
        doubled = run_with_hooks(model, TOKENS, [("blocks.1.ln1.hook_scale", lambda s, name: s * 2)])
        assert not torch.allclose(doubled, model(TOKENS))


def test_attn_in_refuses_grouped_heads():
    model = random_model("llama")
    set_use_attn_in(model, True)
    with pytest.raises(ValueError, match="use_attn_in"):
        model(TOKENS)


@pytest.mark.parametrize("shape", SHAPES)
def test_full_decomposition_adds_up_to_the_stream(shape):
    model = random_model(shape)
    with torch.no_grad():
        _, cache = run_with_cache(model, TOKENS)
    stack = cache.get_full_resid_decomposition()
    torch.testing.assert_close(stack.sum(0), cache["blocks.1.hook_resid_post"], atol=1e-5, rtol=1e-5)
    normed = cache.apply_ln_to_stack(stack, layer=-1).sum(0)  # no gain and bias: ln_final's output before them
    norm = model.ln_final
    shift = norm.bias if getattr(norm, "bias", None) is not None else 0
    torch.testing.assert_close(normed * norm.weight + shift, norm(cache["blocks.1.hook_resid_post"]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("expand_neurons", [True, False])
def test_full_decomposition_of_an_attention_only_model_has_no_mlp_parts(expand_neurons):
    torch.manual_seed(0)
    model = TransformerLM(get_preset("induction-attn-only")).eval()
    with torch.no_grad():
        _, cache = run_with_cache(model, TOKENS)
    stack, labels = cache.get_full_resid_decomposition(expand_neurons=expand_neurons, return_labels=True)
    assert not any("mlp" in label or "N" in label for label in labels)
    assert cache.decompose_resid(return_labels=True)[1] == ["embed", "0_attn_out", "1_attn_out"]
    torch.testing.assert_close(stack.sum(0), cache["blocks.1.hook_resid_post"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("step", ["fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases"])
def test_each_weight_processing_step_keeps_log_probs(shape, step):
    model = random_model(shape)
    processed = copy.deepcopy(model)
    if step == "center_writing_weights" and shape == "llama":  # RMSNorm: nothing to do, as TransformerLens
        with pytest.warns(UserWarning, match="does nothing on an RMSNorm model"):
            weights.center_writing_weights(processed)
        assert all(torch.equal(p, q) for p, q in zip(processed.parameters(), model.parameters()))
        return
    getattr(weights, step)(processed)
    with torch.no_grad():
        torch.testing.assert_close(processed(TOKENS).log_softmax(-1), model(TOKENS).log_softmax(-1),
                                   atol=1e-5, rtol=1e-5)
        changed = [n for n, p in processed.named_parameters()
                   if n not in dict(model.named_parameters()) or not torch.equal(p, dict(model.named_parameters())[n])]
    if step == "fold_value_biases" and shape == "llama":
        assert not changed  # no value biases to fold
    else:
        assert changed, f"{step} changed no weight"


def test_patching_grid_entries_are_the_patched_runs():
    model = random_model("gpt2")
    clean, corrupted = TOKENS[:1], TOKENS[:1].clone()
    corrupted[0, 2] = (corrupted[0, 2] + 5) % 50

    def metric(logits):
        return logits[0, -1, 7]

    grid = patch_residual_stream(model, clean, corrupted, metric)
    with torch.no_grad():
        assert float(grid[0, 2]) == pytest.approx(float(metric(model(clean))), abs=1e-5)  # the only changed token
        assert float(grid[0, 4]) == pytest.approx(float(metric(model(corrupted))), abs=1e-5)  # nothing differs there
        _, clean_cache = run_with_cache(model, clean, names_filter="blocks.1.attn.hook_z")

        def head_2(z, name):
            z = z.clone()
            z[:, :, 2] = clean_cache["blocks.1.attn.hook_z"][:, :, 2]
            return z
        by_hand = metric(run_with_hooks(model, corrupted, [("blocks.1.attn.hook_z", head_2)]))
    assert float(patch_heads(model, clean, corrupted, metric)[1, 2]) == pytest.approx(float(by_hand), abs=1e-6)


def test_attribution_patching_is_the_directional_derivative():
    model = random_model("llama").double()  # float64: the finite difference below is then exact to ~1e-9
    clean, corrupted = TOKENS[:1], TOKENS[:1].clone()
    corrupted[0, 3] = (corrupted[0, 3] + 5) % 50

    def metric(logits):
        return logits[0, -1].log_softmax(-1)[7]

    estimate = attribution_patching(model, clean, corrupted, metric)  # (layers, seq)
    with torch.no_grad():
        _, clean_cache = run_with_cache(model, clean, names_filter="blocks.1.hook_resid_pre")
        _, corrupt_cache = run_with_cache(model, corrupted, names_filter="blocks.1.hook_resid_pre")
    delta = clean_cache["blocks.1.hook_resid_pre"][:, 5] - corrupt_cache["blocks.1.hook_resid_pre"][:, 5]

    def nudged(h):
        def hook(x, name):
            x = x.clone()
            x[:, 5] += h * delta
            return x
        with torch.no_grad():
            return float(metric(run_with_hooks(model, corrupted, [("blocks.1.hook_resid_pre", hook)])))
    h = 1e-4  # central difference of metric along delta: the first-order term attribution patching computes
    assert float(estimate[1, 5]) == pytest.approx((nudged(h) - nudged(-h)) / (2 * h), rel=1e-5, abs=1e-9)


def test_head_scores_on_hand_made_patterns():
    model = random_model("gpt2")
    tokens = repeated_random_tokens(50, half=4, batch=1, generator=torch.Generator().manual_seed(0))
    target = {}

    def set_pattern(kind):
        def hook(pattern, name):
            seq = pattern.shape[-1]
            new = torch.zeros_like(pattern)
            for q in range(seq):
                k = {"prev": q - 1, "dup": q - 4, "ind": q - 3}[kind]
                new[..., q, k if 0 <= k <= q else q] = 1.0  # otherwise attend to self
            return new
        return hook

    for kind in ("prev", "dup", "ind"):
        fwd = [(f"blocks.{i}.attn.hook_pattern", set_pattern(kind)) for i in range(2)]
        from glasslm.interp import hooks as hook_module
        with hook_module.hooks(model, fwd):
            target[kind] = (previous_token_score(model, tokens), duplicate_token_score(model, tokens),
                            induction_score(model, tokens))
    assert torch.allclose(target["prev"][0], torch.ones(2, 4))
    assert torch.allclose(target["dup"][1], torch.ones(2, 4))
    assert torch.allclose(target["ind"][2], torch.ones(2, 4))
    assert float(target["prev"][2].max()) < 0.5 and float(target["ind"][0].max()) < 0.5


def test_head_logit_attribution_adds_up_with_the_rest():
    model = random_model("gpt2")
    weights.process_weights(model)  # folded norms: DLA with the cached scale is then exact
    tokens = TOKENS[:1]
    with torch.no_grad():
        logits, cache = run_with_cache(model, tokens)
    stack = cache.get_full_resid_decomposition(expand_neurons=False)
    total = cache.logit_attrs(stack, 7).sum(0)[0]  # (seq,)
    torch.testing.assert_close(total + model.unembed_bias[7], logits[0, :, 7], atol=1e-4, rtol=1e-4)
    heads = head_logit_attribution(model, tokens, 7)
    torch.testing.assert_close(heads, cache.logit_attrs(cache.stack_head_results(), 7)[:, 0])


def family_model(family: str, dtype: torch.dtype = torch.float64) -> TransformerLM:
    """A two-layer model of each imported family (its HF config.json), every bias the family allows
    switched on, norm gains and biases perturbed off their initial values; float64 so float error is ~1e-15."""
    from glasslm.hf import config_from_hf
    from tests.hf.test_family_registry import HF_CONFIGS
    from tests.interp.tl_reference import perturb

    hf = dict(HF_CONFIGS[family])
    if family in ("llama", "qwen3", "gemma3_text"):
        hf["attention_bias"] = True  # q, k, v (and o) biases: fold_ln and fold_value_biases have work to do
    torch.manual_seed(0)
    return perturb(TransformerLM(config_from_hf(hf)[0]).eval(), scale=2.0).to(dtype)


FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gemma3_text"]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_weight_processing_keeps_every_familys_log_probs(family):
    """fold_ln, center_writing_weights, center_unembed, fold_value_biases: log-probs within float64 error on
    every registered family, Gemma 3's (1 + w) norms, sandwich post-norms and q/k norms included."""
    model = family_model(family)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    before = model(tokens).log_softmax(-1)
    weights.fold_ln(model)
    folded = [model.ln_final] + [norm for block in model.blocks for norm in (block.ln1, block.ln2)]
    for norm in folded:  # the pre-norms are now plain divisions: gain 1 (weight 0 under (1 + w))
        assert torch.all(weights.norm_gain(norm) == 1.0) and torch.all(getattr(norm, "bias", torch.zeros(1)) == 0)
    torch.testing.assert_close(model(tokens).log_softmax(-1), before, atol=1e-12, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RMSNorm families: a documented no-op
        weights.center_writing_weights(model)
    weights.center_unembed(model)
    weights.fold_value_biases(model)
    torch.testing.assert_close(model(tokens).log_softmax(-1), before, atol=1e-12, rtol=0)
    assert model.unembed.weight.mean(0).abs().max() < 1e-12


@torch.no_grad()
def test_gemma3_heads_and_neurons_add_up_through_the_post_norms():
    """A post-norm's divisor, taken from the cache, makes each head's and neuron's write exact."""
    model = family_model("gemma3_text", torch.float32)
    weights.process_weights(model)
    tokens = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    _, cache = run_with_cache(model, tokens)
    for layer in range(2):
        attn = model.blocks[layer].attn
        attn_bias = cache.accumulated_bias(layer, mlp_input=True) - cache.accumulated_bias(layer)  # (batch, seq, d)
        torch.testing.assert_close(cache.head_results(layer).sum(-2) + attn_bias, cache["attn_out", layer],
                                   atol=1e-5, rtol=1e-5)
        z_w_o = cache["z", layer].flatten(-2) @ attn.out.weight.T  # before the post-norm: not what is added
        assert not torch.allclose(z_w_o, cache["attn_out", layer], atol=1e-2)
        torch.testing.assert_close(cache.neuron_results(layer).sum(-2), cache["mlp_out", layer], atol=1e-5, rtol=1e-5)
    stack, labels = cache.get_full_resid_decomposition(return_labels=True)
    torch.testing.assert_close(stack.sum(0), cache["resid_post", 1], atol=1e-5, rtol=1e-5)
    assert labels[-3:] == ["L1N47", "embed", "bias"]
    with pytest.raises(KeyError, match="ln1_post.hook_scale"):
        run_with_cache(model, tokens, names_filter=["blocks.0.attn.hook_z"])[1].head_results(0)

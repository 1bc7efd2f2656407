"""glasslm's hooks, cache methods, weight processing and patching against TransformerLens 4.3 itself.

The same random model is built in both: glasslm exports it to HF and TransformerLens boots that
directory with `TransformerBridge.boot_transformers` (offline). Two conventions differ and are
mapped here as docs/inspection.md describes: `ln*.hook_normalized` (glasslm: after gain and bias;
TL: before), and rotary models' q/k features (glasslm pairs adjacent features, HF/TL the two halves).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformer_lens")

from glasslm.interp import params, patching  # noqa: E402
from glasslm.interp.hooks import run_with_cache, set_use_attn_result  # noqa: E402
from glasslm.interp.weights import process_weights  # noqa: E402
from tests.interp.tl_reference import build_pair  # noqa: E402

pytestmark = pytest.mark.slow  # booting TransformerLens takes ~10 s per model
TOL = 1e-5
TOKENS_2 = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(2))


def close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> float:
    """Max |difference| over finite entries, checked ≤ TOL relative to the values' size (at least 1)."""
    assert ours.shape == theirs.shape, f"{what}: {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    finite = torch.isfinite(theirs)
    assert torch.equal(finite, torch.isfinite(ours)), what
    diff = (ours - theirs)[finite].abs().max().item() if finite.any() else 0.0
    scale = max(1.0, theirs[finite].abs().max().item())
    assert diff <= TOL * scale, f"{what}: max difference {diff:.2e} (values up to {scale:.1f})"
    return diff


def hf_feature_order(d_head: int) -> torch.Tensor:
    """Our adjacent-pair rotary features in HF's half-split order: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat([torch.arange(0, d_head, 2), torch.arange(1, d_head, 2)])


ROTARY_ORDERED = ("hook_q", "hook_k", "hook_rot_q", "hook_rot_k", "hook_q_normed", "hook_k_normed")


def as_tl(model, name: str, activation: torch.Tensor) -> torch.Tensor:
    """Our activation in TransformerLens's convention (the one that differs: rotary feature order)."""
    if name.endswith(("q_norm.hook_normalized", "k_norm.hook_normalized")):
        name = "hook_q"
    if model.config.positional == "rope" and name.rsplit(".", 1)[-1] in ROTARY_ORDERED:
        return activation[..., hf_feature_order(activation.shape[-1])]
    return activation


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen3", "gemma3"])
def pair(request, tmp_path_factory):
    model, bridge = build_pair(request.param, tmp_path_factory.mktemp(request.param) / "hf")
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    return request.param, model, bridge, tokens


@pytest.fixture(scope="module")
def caches(pair):
    shape, model, bridge, tokens = pair
    with torch.no_grad():
        theirs_logits, theirs = bridge.run_with_cache(tokens)
        logits, ours = run_with_cache(model, tokens)
    return logits, ours, theirs_logits, theirs


def test_every_common_hook_matches(pair, caches):
    shape, model, _, _ = pair
    logits, ours, theirs_logits, theirs = caches
    close(logits, theirs_logits, "logits")
    assert not set(ours) - set(theirs.keys()), "every hook point glasslm fires here, TL has"
    common = list(ours)
    named = ["hook_embed", "hook_unembed", "blocks.0.ln1.hook_normalized", "ln_final.hook_normalized"]
    if model.config.qk_norm:  # (batch, heads, seq, d_head) in both
        named += ["blocks.0.attn.hook_q_normed", "blocks.1.attn.hook_k_normed", "blocks.0.attn.q_norm.hook_scale"]
    assert set(named) <= set(common), set(named) - set(common)
    report = {name: close(as_tl(model, name, ours[name]), theirs[name], name) for name in common}
    print(f"\n{shape}: {len(report)} hooks, max differences", {k: f"{v:.1e}" for k, v in report.items()})


def test_per_head_results_match_tl(pair, caches):
    shape, model, bridge, tokens = pair
    _, _, _, theirs = caches
    set_use_attn_result(model, True)
    try:
        with torch.no_grad():
            _, ours = run_with_cache(model, tokens, names_filter=lambda n: n.endswith("hook_result"))
    finally:
        set_use_attn_result(model, False)
    stack = theirs.stack_head_results(layer=-1)  # (layers * heads, batch, seq, d_model)
    raw = torch.cat([ours[f"blocks.{layer}.attn.hook_result"] for layer in range(2)], dim=-2).movedim(-2, 0)
    close(raw, stack, "hook_result")  # each head's z W_O, before a post-norm (Gemma 3's) in both
    if not model.config.post_norms:
        close(ours.stack_head_results(layer=-1), stack, "stack_head_results via hook_result")


def through_tl_post_norm(model, theirs, stack, sublayer: str, per_layer: int):
    """TL's per-head (per-neuron) stack, taken through each block's post-norm with TL's own cached scale:
    what glasslm's stacks are on a sandwich-norm model (they then add up to the sublayer's output)."""
    norm_name = "ln1_post" if sublayer == "attn" else "ln2_post"
    layers = []
    for layer, chunk in enumerate(stack.split(per_layer)):
        norm = getattr(model.blocks[layer], norm_name)
        layers.append(chunk / theirs[f"blocks.{layer}.{norm_name}.hook_scale"] * (1 + norm.weight))
    return torch.cat(layers)


def test_post_norm_heads_and_neurons_are_tls_through_the_cached_post_norm(pair, caches):
    shape, model, _, _ = pair
    if not model.config.post_norms:
        pytest.skip("no post-norms: the stacks are compared as they are in test_cache_methods_match_tl")
    _, ours, _, theirs = caches
    heads = through_tl_post_norm(model, theirs, theirs.stack_head_results(layer=-1), "attn", model.config.n_heads)
    close(ours.stack_head_results(layer=-1), heads, "stack_head_results")
    neurons = through_tl_post_norm(model, theirs, theirs.stack_neuron_results(layer=2), "mlp", model.config.d_mlp)
    close(ours.stack_neuron_results(layer=2), neurons, "stack_neuron_results")
    stream = ours["blocks.1.hook_resid_post"]
    close(ours.get_full_resid_decomposition().sum(0), stream, "our decomposition adds up to the stream")
    tl_gap = (theirs.get_full_resid_decomposition().sum(0) - stream).abs().max()
    assert tl_gap > 1e-2, "TL's z W_O parts skip the post-norm, so its decomposition does not add up"


CACHE_CALLS = {
    "accumulated_resid": [dict(), dict(incl_mid=True, return_labels=True), dict(layer=1, apply_ln=True),
                          dict(apply_ln=True, pos_slice=-1), dict(layer=1, mlp_input=True, apply_ln=True)],
    "decompose_resid": [dict(return_labels=True), dict(layer=1, mode="attn", apply_ln=True),
                        dict(apply_ln=True, pos_slice=(2, 6)), dict(layer=1, mlp_input=True, apply_ln=True)],
    "stack_head_results": [dict(return_labels=True), dict(layer=1, incl_remainder=True, apply_ln=True),
                           dict(apply_ln=True, pos_slice=-1)],
    "stack_neuron_results": [dict(layer=1, return_labels=True), dict(layer=2, apply_ln=True, pos_slice=-1),
                             dict(layer=1, incl_remainder=True, apply_ln=True)],
    "get_full_resid_decomposition": [dict(return_labels=True), dict(apply_ln=True, pos_slice=-1),
                                     dict(layer=1, expand_neurons=False, return_labels=True),
                                     dict(layer=1, mlp_input=True, apply_ln=True)],
}


@pytest.mark.parametrize("method", sorted(CACHE_CALLS))
def test_cache_methods_match_tl(pair, caches, method):
    shape, model, _, _ = pair
    if model.config.post_norms and method in ("stack_head_results", "stack_neuron_results",
                                              "get_full_resid_decomposition"):
        pytest.skip("glasslm's parts pass the post-norms: test_post_norm_heads_and_neurons_are_tls_through_...")
    _, ours, _, theirs = caches
    worst = 0.0
    for kwargs in CACHE_CALLS[method]:
        mine, tl = getattr(ours, method)(**kwargs), getattr(theirs, method)(**kwargs)
        if kwargs.get("return_labels"):
            assert mine[1] == tl[1], (method, kwargs)
            mine, tl = mine[0], tl[0]
        worst = max(worst, close(mine, tl, f"{method}({kwargs})"))
    print(f"\n{shape}: {method} max difference {worst:.2e}")


def test_apply_ln_and_logit_attrs_match_tl(pair, caches):
    shape, _, _, tokens = pair
    _, ours, _, theirs = caches
    stack = theirs.decompose_resid()
    close(ours.apply_ln_to_stack(stack, layer=1), theirs.apply_ln_to_stack(stack, layer=1), "apply_ln_to_stack")
    close(ours.apply_ln_to_stack(stack, layer=0, mlp_input=True),
          theirs.apply_ln_to_stack(stack, layer=0, mlp_input=True), "apply_ln_to_stack mlp_input")
    answers, wrong = tokens[:, -1], tokens[:, 0]
    close(ours.logit_attrs(stack, answers, wrong), theirs.logit_attrs(stack, answers, wrong), "logit_attrs diff")
    close(ours.logit_attrs(stack[:, :, -1], 7, pos_slice=-1), theirs.logit_attrs(stack[:, :, -1], 7, pos_slice=-1),
          "logit_attrs one token")


def test_activation_patching_matches_tl(pair):
    shape, model, bridge, tokens = pair
    clean, corrupted = tokens[:1], tokens[:1].clone()
    corrupted[0, 3] = (corrupted[0, 3] + 1) % model.config.vocab_size
    answer = int(clean[0, -1])

    def metric(logits):
        return logits[0, -1].log_softmax(-1)[answer]

    with torch.no_grad():
        _, tl_cache = bridge.run_with_cache(clean)
        _, our_cache = run_with_cache(model, clean)
    from transformer_lens import patching as tl_patching
    for name in ["get_act_patch_resid_pre", "get_act_patch_attn_out", "get_act_patch_attn_head_out_all_pos"]:
        theirs = getattr(tl_patching, name)(bridge, corrupted, tl_cache, metric)
        ours = getattr(patching, name)(model, corrupted, our_cache, metric)
        close(ours, theirs, name)


@pytest.mark.parametrize("shape", ["gpt2", "llama", "qwen3", "gemma3"])
def test_processed_weights_match_tl(tmp_path, shape):
    """After TL's default processing (fold_ln, center_writing_weights, center_unembed, fold_value_biases):
    the same log-probs and the same folded weights, Gemma 3's (1 + w) norms and sandwich included."""
    model, bridge = build_pair(shape, tmp_path / "hf", processing=True)
    before = model(TOKENS_2).log_softmax(-1)
    process_weights(model)
    with torch.no_grad():
        theirs_logits, theirs = bridge.run_with_cache(TOKENS_2)
        logits, ours = run_with_cache(model, TOKENS_2)
    close(logits.log_softmax(-1), before, "our log-probs, processed vs not")
    close(logits, theirs_logits, "logits")
    for name in ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_v", "blocks.1.hook_attn_out", "blocks.1.hook_resid_post"]:
        close(ours[name], theirs[name], f"processed {name}")
    order = hf_feature_order(model.config.d_head) if model.config.positional == "rope" else slice(None)
    for name in ["W_Q", "W_K"]:  # rotary: glasslm's adjacent-pair feature order within a head
        close(getattr(params, name)(model)[..., order], getattr(bridge, name), name)
    for name in ["W_V", "W_O", "W_in", "W_out", "W_U", "b_U", "W_E"] + (["W_gate"] if bridge.W_gate is not None else []):
        close(getattr(params, name)(model), getattr(bridge, name), name)
    if shape == "gpt2":
        for name in ["b_Q", "b_K", "b_V", "b_O", "b_in", "b_out", "W_pos"]:
            close(getattr(params, name)(model), getattr(bridge, name), name)

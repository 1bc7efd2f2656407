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

from glasslm.interp import patching  # noqa: E402
from glasslm.interp.hooks import run_with_cache, set_use_attn_result  # noqa: E402
from glasslm.interp.weights import process_weights  # noqa: E402
from tests.interp.tl_reference import build_pair  # noqa: E402

pytestmark = pytest.mark.slow  # booting TransformerLens takes ~10 s per model
TOL = 1e-5


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


def as_tl(model, name: str, activation: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """Our activation in TransformerLens's convention."""
    if name.endswith("hook_normalized"):  # ours is after the gain and bias; TL's before
        norm = model.get_submodule(name.rsplit(".", 1)[0])
        shift = getattr(norm, "bias", None)
        return (activation - (0 if shift is None else shift)) / norm.weight
    if model.config.positional == "rope" and name.rsplit(".", 1)[-1] in ("hook_q", "hook_k", "hook_rot_q", "hook_rot_k"):
        return activation[..., hf_feature_order(activation.shape[-1])]
    if name == "hook_pos_embed":
        return activation.expand_as(theirs)
    return activation


@pytest.fixture(scope="module", params=["gpt2", "llama"])
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
    report = {name: close(as_tl(model, name, ours[name], theirs[name]), theirs[name], name) for name in common}
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
    close(ours.stack_head_results(layer=-1), stack, "stack_head_results via hook_result")


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
    shape, _, _, _ = pair
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


def test_processed_weights_match_tl(tmp_path):
    """After TL's default processing (fold_ln, center_writing_weights, center_unembed, fold_value_biases)."""
    model, bridge = build_pair("gpt2", tmp_path / "hf", processing=True)
    process_weights(model)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs_logits, theirs = bridge.run_with_cache(tokens)
        logits, ours = run_with_cache(model, tokens)
    close(logits, theirs_logits, "logits")
    for name in ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_v", "blocks.1.hook_attn_out", "blocks.1.hook_resid_post"]:
        close(ours[name], theirs[name], f"processed {name}")
    n_heads, d_head, d_model = 4, 16, 64
    for layer, block in enumerate(model.blocks):
        w_q = block.attn.qkv.weight[: n_heads * d_head].view(n_heads, d_head, d_model).transpose(1, 2)
        close(w_q, bridge.W_Q[layer], "W_Q")
        close(block.attn.out.bias, bridge.b_O[layer], "b_O")
        close(block.mlp.down.weight.T, bridge.W_out[layer], "W_out")
    close(model.unembed.weight.T, bridge.W_U, "W_U")
    close(model.unembed_bias, bridge.b_U, "b_U")
    close(model.embed.weight, bridge.W_E, "W_E")

"""Mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE), each from a tiny random config saved by
transformers with every weight perturbed: logits within twice transformers' own float32-vs-float64
error (both MoE paths), 20 greedy tokens equal to transformers' (full forward, KV cache, static
cache), export -> import -> export byte-identical and read back by transformers to the same logits.
Nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig  # noqa: E402

from glasslm.core.moe import MoE  # noqa: E402
from glasslm.hf import UnsupportedModelError, export_hf, import_hf  # noqa: E402
from tests.hf.test_hf_families import VOCAB, _llama, float32_rounding, random_model  # noqa: E402
from tests.hf.test_hf_new_families import SPECIAL, assert_decodes_like_transformers_and_round_trips  # noqa: E402

# Eight experts, two per token; 3 layers so that a decoder_sparse_step of 2 leaves dense layers around one.
# transformers' eager experts: its grouped_mm path has no float64, which float32_rounding runs.
_EXPERTS = dict(num_experts_per_tok=2, num_hidden_layers=3, router_aux_loss_coef=0.02, experts_implementation="eager")

FAMILIES = {
    "mixtral": lambda: MixtralConfig(**{**_llama(num_local_experts=8, **_EXPERTS), **SPECIAL}),
    # Qwen3-MoE: q/k norms, head_dim 16 over 40, experts of 24 on layer 1 only, dense MLPs of 80, not renormalised.
    "qwen3-moe-sparse-step": lambda: Qwen3MoeConfig(**{**_llama(
        hidden_size=40, head_dim=16, num_experts=8, moe_intermediate_size=24, decoder_sparse_step=2,
        norm_topk_prob=False, mlp_only_layers=[], **_EXPERTS), **SPECIAL}),
    # Every layer a mixture, renormalised, tied embeddings.
    "qwen3-moe-renormalised": lambda: Qwen3MoeConfig(**{**_llama(
        num_experts=6, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[],
        tie_word_embeddings=True, **_EXPERTS), **SPECIAL}),
    # OLMoE: q/k norms over the whole projections (grouped heads: the k norm is narrower), softmax weights
    # not renormalised, experts of intermediate_size on every layer.
    "olmoe": lambda: OlmoeConfig(**{**_llama(
        num_experts=8, intermediate_size=24, norm_topk_prob=False, **_EXPERTS), **SPECIAL}),
    # Qwen2-MoE: q/k/v biases and a sigmoid-gated shared expert of 56 beside experts of 24.
    "qwen2-moe": lambda: Qwen2MoeConfig(**{**_llama(
        num_experts=8, moe_intermediate_size=24, shared_expert_intermediate_size=56, decoder_sparse_step=1,
        norm_topk_prob=False, mlp_only_layers=[], **_EXPERTS), **SPECIAL}),
}


def set_impl(model, impl):
    model.config.impl = impl
    for module in model.modules():
        if hasattr(module, "impl"):
            module.impl = impl


@pytest.mark.slow  # ~10 s a family
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_moe_family_logits_greedy_tokens_and_round_trip(family, tmp_path):
    hf_model = random_model(FAMILIES[family]())
    hf_model.save_pretrained(tmp_path / "hf")
    model = import_hf(tmp_path / "hf")
    assert any(isinstance(block.mlp, MoE) for block in model.blocks)
    assert model.config.moe_aux_loss_coef == 0.02
    tokens = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = hf_model(tokens).logits
    assert expected.abs().max() > 1.0
    atol = 2 * float32_rounding(hf_model, tokens)
    for impl in ("fast", "readable"):
        set_impl(model, impl)
        got = model(tokens)
        print(f"{family} [{impl}]: max |logit diff| {(got - expected).abs().max().item():.2e}, tolerance {atol:.2e}")
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    set_impl(model, "fast")
    assert_decodes_like_transformers_and_round_trips(model, hf_model, tokens, expected, tmp_path)


@torch.no_grad()
def test_transformers_fused_expert_layout_reads_as_the_per_expert_one(tmp_path):
    """transformers 5 holds experts fused ((n, 2 d_expert, d_model) gate|up); a file saved in that layout
    loads to the same model as the per-expert checkpoint layout."""
    from safetensors.torch import save_file

    hf_model = random_model(FAMILIES["qwen3-moe-renormalised"]())
    hf_model.save_pretrained(tmp_path / "hf")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # (tied)
    save_file(state, str(fused / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in hf_model.state_dict())
    a, b = import_hf(tmp_path / "hf"), import_hf(fused)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_what_olmoe_files_say_that_glasslm_does_not_compute_is_refused_by_name(tmp_path):
    config = OlmoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_experts=4, num_experts_per_tok=2, clip_qkv=8.0, **SPECIAL)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "olmoe")
    with pytest.raises(UnsupportedModelError, match="OLMoE with clip_qkv=8.0"):
        import_hf(tmp_path / "olmoe")


def test_dense_families_do_not_claim_an_moe_config_and_moe_ones_not_a_dense_one():
    from glasslm.hf.families import family_of
    from glasslm.hf.families.mixtral import FAMILY as MIXTRAL
    from glasslm.presets import get_preset

    dense = get_preset("llama-tiny")
    assert "no experts (a dense model)" in MIXTRAL.fit_problems(dense)
    moe = dense.replace(n_experts=4, experts_per_token=2)
    assert family_of(moe) == "mixtral"
    assert family_of(moe.replace(qk_norm=True)) == "qwen3_moe"
    assert family_of(moe.replace(d_shared_expert=32, attn_qkv_bias=True)) == "qwen2_moe"
    assert family_of(moe.replace(qk_norm=True, moe_every=2, router_renormalize=False, d_expert=16)) == "qwen3_moe"
    olmoe = moe.replace(qk_norm=True, qk_norm_whole=True, router_renormalize=False)
    assert family_of(olmoe) == "olmoe"
    assert family_of(olmoe.replace(router_renormalize=True)) == "olmoe"  # (norm_topk_prob)
    with pytest.raises(UnsupportedModelError, match="not mixtral: .*experts every 2 layers"):
        family_of(moe.replace(moe_every=2))
    with pytest.raises(UnsupportedModelError, match="not qwen3_moe: .*q/k norms over the whole projection"):
        family_of(olmoe.replace(moe_every=2))

"""Hook points: caching, replacing activations, ablations, and zero cost when unused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from glasslm.presets import get_preset
from glasslm.interp.hooks import hook_names, logit_lens, run_with_cache, run_with_hooks, unembed
from glasslm.core.model import TransformerLM

PRESETS = ["shakespeare-char-cpu-nanogpt", "shakespeare-char-cpu", "llama-tiny"]


def small_model(preset: str, impl: str = "fast") -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_preset(preset, n_layers=3, impl=impl, dropout=0.0)).eval()


def tokens_for(model: TransformerLM, seq: int = 10) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(3))


def test_hook_names_are_module_paths():
    names = set(hook_names(small_model("llama-tiny")))
    for name in ["hook_embed", "hook_pos_embed", "ln_final.hook_normalized", "blocks.0.ln1.hook_normalized"]:
        assert name in names
    for suffix in ["hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores",
                   "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "mlp.hook_pre",
                   "mlp.hook_post", "hook_mlp_out", "hook_resid_post"]:
        assert f"blocks.2.{suffix}" in names


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_cache_holds_only_requested_activations_and_logits_are_unchanged(preset):
    model = small_model(preset)
    tokens = tokens_for(model)
    plain = model(tokens)
    logits, cache = run_with_cache(model, tokens, names_filter=["blocks.1.hook_resid_post", "blocks.0.attn.hook_z"])
    assert set(cache) == {"blocks.1.hook_resid_post", "blocks.0.attn.hook_z"}
    torch.testing.assert_close(logits, plain)
    assert cache["blocks.0.attn.hook_z"].shape == (2, 10, model.config.n_heads, model.config.d_head)
    _, by_predicate = run_with_cache(model, tokens, names_filter=lambda name: name.endswith("hook_mlp_out"))
    assert sorted(by_predicate) == [f"blocks.{i}.hook_mlp_out" for i in range(3)]
    with pytest.raises(KeyError, match="blocks.7.hook_resid_post"):
        run_with_cache(model, tokens, names_filter=["blocks.7.hook_resid_post"])


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_last_resid_post_through_final_norm_and_unembed_reproduces_logits(preset):
    model = small_model(preset)
    tokens = tokens_for(model)
    logits, cache = run_with_cache(model, tokens, names_filter="blocks.2.hook_resid_post")
    torch.testing.assert_close(unembed(model, cache["blocks.2.hook_resid_post"]), logits, atol=1e-5, rtol=1e-5)
    lens = logit_lens(model, tokens)
    assert lens.shape == (3, 2, 10, model.config.vocab_size)
    torch.testing.assert_close(lens[-1], torch.log_softmax(logits, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_attention_pattern_rows_sum_to_one_and_are_causal(preset):
    model = small_model(preset)
    tokens = tokens_for(model)
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(3)]
    logits, cache = run_with_cache(model, tokens, names_filter=names)
    torch.testing.assert_close(logits, model(tokens), atol=1e-5, rtol=1e-5)  # readable path, same numbers
    for name in names:
        pattern = cache[name]
        assert pattern.shape == (2, model.config.n_heads, 10, 10)
        torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[:-1]))
        future = torch.ones(10, 10, dtype=torch.bool).triu(diagonal=1)
        assert (pattern[..., future] == 0).all()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("impl", ["fast", "readable"])
@torch.no_grad()
def test_zero_ablating_a_head_equals_removing_its_out_projection_columns(preset, impl):
    model = small_model(preset, impl)
    tokens = tokens_for(model)
    layer, head, d_head = 1, 2, model.config.d_head

    def zero_head(z, hook_name):
        assert hook_name == f"blocks.{layer}.attn.hook_z"
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    watched = ["blocks.0.hook_resid_post", f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_v"]
    clean_logits, clean = run_with_cache(model, tokens, names_filter=watched)
    ablated_logits, ablated = run_with_cache(
        model, tokens, names_filter=watched, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)]
    )
    # Manual recomputation: the head's output reaches the residual stream only through its
    # d_head columns of the out projection, so zeroing those columns removes exactly its contribution.
    manual = copy.deepcopy(model)
    manual.blocks[layer].attn.out.weight[:, head * d_head:(head + 1) * d_head] = 0.0
    torch.testing.assert_close(ablated_logits, manual(tokens), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ablated_logits, clean_logits)
    for name in watched:  # everything before the ablated head's output is untouched
        assert torch.equal(ablated[name], clean[name]), name


def test_hooks_are_removed_even_when_the_forward_pass_fails():
    model = small_model("llama-tiny")

    def broken(activation, hook_name):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, tokens_for(model), fwd_hooks=[("blocks.1.hook_resid_mid", broken)])
    assert not any(m._forward_hooks for m in model.modules())
    run_with_cache(model, tokens_for(model), names_filter=["blocks.0.hook_resid_post"])
    assert not any(m._forward_hooks for m in model.modules())


def test_replacing_an_activation_changes_downstream_only():
    model = small_model("shakespeare-char-cpu")
    tokens = tokens_for(model)
    with torch.no_grad():
        double = run_with_hooks(model, tokens, fwd_hooks=[("ln_final.hook_normalized", lambda x, name: 2 * x)])
        torch.testing.assert_close(double, 2 * model(tokens), atol=1e-5, rtol=1e-5)
        keep = run_with_hooks(model, tokens, fwd_hooks=[("hook_embed", lambda x, name: None)])
        torch.testing.assert_close(keep, model(tokens))


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_attention_is_kept_unless_the_pattern_is_requested(preset, monkeypatch):
    model = small_model(preset, impl="fast")
    tokens = tokens_for(model)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(1)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    with torch.no_grad():
        run_with_cache(model, tokens, names_filter=lambda n: "resid" in n or n.endswith(("hook_z", "hook_q")))
        assert len(calls) == 3  # every layer used the fused kernel
        calls.clear()
        run_with_cache(model, tokens, names_filter=["blocks.1.attn.hook_pattern"])
        assert len(calls) == 2  # only the hooked layer fell back to the readable path
        calls.clear()
        model(tokens)
        assert len(calls) == 3


def test_hook_point_without_hooks_returns_the_same_tensor_object():
    model = small_model("llama-tiny")
    x = torch.randn(2, 3, 128)
    assert model.blocks[0].hook_resid_pre(x) is x  # no copy when nothing is attached


# --- pictures (glasslm.interp.inspection and `glasslm inspect`) ----------------------------------------------

@pytest.fixture
def char_checkpoint(tmp_path):
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.tokenizers import CharTokenizer

    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ,.:\n")
    model = TransformerLM(get_preset("shakespeare-char-cpu", n_layers=2, vocab_size=tokenizer.vocab_size))
    return save_checkpoint(tmp_path / "ckpt", model, tokenizer)


def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000


def test_inspect_commands_write_pngs(char_checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    from glasslm.cli import main

    common = ["--checkpoint", str(char_checkpoint), "--prompt", "romeo: what light"]
    assert main(["inspect", "attention", *common, "--layer", "1", "--head", "3", "--out", str(tmp_path / "a.png")]) == 0
    assert _is_png(tmp_path / "a.png")
    assert main(["inspect", "logit-lens", *common, "--out", str(tmp_path / "l.png")]) == 0
    assert _is_png(tmp_path / "l.png")
    assert main(["inspect", "attention", *common, "--layer", "2", "--head", "0", "--out", str(tmp_path / "x.png")]) == 1
    assert main(["inspect", "attention", *common, "--layer", "0", "--head", "4", "--out", str(tmp_path / "x.png")]) == 1


@torch.no_grad()
def test_logit_lens_top_tokens_of_last_layer_are_the_models_argmax():
    from glasslm.interp.inspection import attention_pattern, logit_lens_top

    model = small_model("llama-tiny")
    tokens = tokens_for(model)[:1]
    top_ids, top_probs = logit_lens_top(model, tokens)
    logits = model(tokens)[0]
    assert torch.equal(top_ids[-1], logits.argmax(-1))
    torch.testing.assert_close(top_probs[-1], torch.softmax(logits, -1).amax(-1), atol=1e-5, rtol=1e-5)
    assert attention_pattern(model, tokens, layer=2).shape == (8, 10, 10)

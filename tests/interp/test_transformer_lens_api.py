"""What a TransformerLens user reaches for, against TransformerLens 4.3 itself on the same weights: text
input, to_tokens / to_str_tokens / to_string, return_type, stop_at_layer, remove_batch_dim, the
cache's stack_activation / compute_head_results / to, the stacked W_Q ... W_U and the OV / QK circuits
with FactoredMatrix's semantics (checked against TransformerLens's own FactoredMatrix).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformer_lens")

from glasslm.interp import params  # noqa: E402
from glasslm.interp.factored import FactoredMatrix  # noqa: E402
from glasslm.interp.hooked import HookedModel  # noqa: E402
from glasslm.interp.hooks import run_with_cache, run_with_hooks  # noqa: E402
from glasslm.interp.tokens import to_str_tokens, to_string, to_tokens  # noqa: E402
from tests.interp.test_transformer_lens import as_tl, close, hf_feature_order  # noqa: E402
from tests.interp.tl_reference import build_pair, reference_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # booting TransformerLens
TEXTS = ["the quick brown fox jumps", "lazy dog"]


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma3"])
def pair(request, tmp_path_factory):
    model, bridge = build_pair(request.param, tmp_path_factory.mktemp(request.param) / "hf")
    return request.param, HookedModel(model, reference_tokenizer()), bridge


def test_tokens_and_strings_match_tl(pair):
    _, model, bridge = pair
    tok = model.tokenizer
    for kwargs in (dict(), dict(prepend_bos=False), dict(prepend_bos=True)):
        assert torch.equal(to_tokens(tok, TEXTS, **kwargs), bridge.to_tokens(TEXTS, **kwargs)), kwargs
        assert torch.equal(model.to_tokens(TEXTS[0], **kwargs), bridge.to_tokens(TEXTS[0], **kwargs)), kwargs
        assert to_str_tokens(tok, TEXTS[0], **kwargs) == bridge.to_str_tokens(TEXTS[0], **kwargs)
    assert model.to_str_tokens(TEXTS) == bridge.to_str_tokens(TEXTS)
    ids = bridge.to_tokens(TEXTS)
    assert to_string(tok, ids) == bridge.to_string(ids) and to_string(tok, ids[1]) == bridge.to_string(ids[1])
    assert model.to_str_tokens(ids[0]) == bridge.to_str_tokens(ids[0])
    assert model.to_single_token("the") == bridge.to_single_token("the")


@torch.no_grad()
def test_text_input_return_types_and_stop_at_layer_match_tl(pair):
    _, model, bridge = pair
    theirs_logits, theirs = bridge.run_with_cache(TEXTS[0])
    logits, ours = model.run_with_cache(TEXTS[0])  # tokenized with the model's tokenizer, bos first
    close(logits, theirs_logits, "run_with_cache(text) logits")
    close(ours["blocks.1.hook_resid_post"], theirs["blocks.1.hook_resid_post"], "resid_post")
    close(run_with_hooks(model.model, TEXTS, tokenizer=model.tokenizer), bridge(TEXTS), "run_with_hooks(texts)")
    tokens = bridge.to_tokens(TEXTS)
    close(model(tokens, return_type="loss"), bridge(tokens, return_type="loss"), "loss")
    close(model(tokens, return_type="loss", loss_per_token=True),
          bridge(tokens, return_type="loss", loss_per_token=True), "loss per token")
    ours_both, theirs_both = model(tokens, return_type="both"), bridge(tokens, return_type="both")
    close(ours_both[0], theirs_both[0], "both: logits")
    close(ours_both[1], theirs_both[1], "both: loss")
    assert model(tokens, return_type=None) is None and bridge(tokens, return_type=None) is None
    for layer in (0, 1, 2, -1):
        close(model(tokens, stop_at_layer=layer), bridge(tokens, stop_at_layer=layer), f"stop_at_layer={layer}")
    _, theirs_part = bridge.run_with_cache(tokens, stop_at_layer=1)
    resid, ours_part = run_with_cache(model.model, tokens, stop_at_layer=1)
    close(resid, theirs_part["blocks.0.hook_resid_post"], "stop_at_layer=1 stream")
    assert "blocks.0.hook_resid_post" in ours_part and not any(name.startswith("blocks.1.") for name in ours_part)
    assert set(ours_part) <= set(theirs_part.keys())


@torch.no_grad()
def test_remove_batch_dim_and_cache_methods_match_tl(pair):
    _, model, bridge = pair
    tokens = bridge.to_tokens(TEXTS[0])
    _, theirs = bridge.run_with_cache(tokens, remove_batch_dim=True)
    _, ours = model.run_with_cache(tokens, remove_batch_dim=True)
    assert not ours.has_batch_dim and not theirs.has_batch_dim
    for name in ours:
        close(as_tl(model.model, name, ours[name]), theirs[name], name)
    close(ours.accumulated_resid(apply_ln=True, pos_slice=-1), theirs.accumulated_resid(apply_ln=True, pos_slice=-1),
          "accumulated_resid without a batch")
    close(ours.decompose_resid(layer=1), theirs.decompose_resid(layer=1), "decompose_resid without a batch")
    close(ours.stack_activation("resid_post"), theirs.stack_activation("resid_post"), "stack_activation resid_post")
    close(ours.stack_activation("pattern", layer=1), theirs.stack_activation("pattern", layer=1), "stack_activation pattern")
    close(ours.stack_activation("scale", sublayer_type="ln2"), theirs.stack_activation("scale", sublayer_type="ln2"),
          "stack_activation scale ln2")
    ours.compute_head_results()
    theirs.compute_head_results()
    close(ours["result", 1], theirs["result", 1], "compute_head_results")
    assert ours.to("cpu") is ours and ours["resid_pre", 0].device.type == "cpu"
    with pytest.raises(ValueError, match="batch of one"):
        model.run_with_cache(bridge.to_tokens(TEXTS), remove_batch_dim=True)


def test_stacked_weights_match_tl(pair):
    shape, model, bridge = pair
    order = hf_feature_order(model.config.d_head) if model.config.positional == "rope" else slice(None)
    for name in ["W_Q", "W_K"]:
        close(getattr(model, name)[..., order], getattr(bridge, name), name)
    for name in ["W_V", "W_O", "W_in", "W_out", "W_U", "W_E"]:
        close(getattr(model, name), getattr(bridge, name), name)
    assert (model.W_gate is None) == (bridge.W_gate is None)
    if shape == "gpt2":
        for name in ["W_pos", "b_Q", "b_K", "b_V", "b_O", "b_in", "b_out", "b_U"]:
            close(getattr(model, name), getattr(bridge, name), name)
    else:
        with pytest.raises(ValueError, match="rope"):
            model.W_pos
        assert not model.b_O.any()  # no bias: zeros (TransformerLens 4's bridge raises)


def sorted_eigenvalues(values: torch.Tensor) -> torch.Tensor:
    """Eigenvalues in a canonical order (by real part, then imaginary), per leading index."""
    key = values.real * 1e4 + values.imag  # real parts differ by far more than 1e-4 here
    return values.gather(-1, key.argsort(-1))


def test_circuits_and_factored_matrix_match_tl(pair):
    from transformer_lens import FactoredMatrix as TLFactored

    _, model, bridge = pair
    for name in ("OV", "QK"):
        ours, theirs = getattr(model, name), getattr(bridge, name)
        assert ours.shape == theirs.shape and ours.mdim == theirs.mdim
        close(ours.AB, theirs.AB, f"{name}.AB")  # the rotary feature order cancels inside the product
        check_factored_semantics(ours.A, ours.B, TLFactored)


def check_factored_semantics(A: torch.Tensor, B: torch.Tensor, tl_class) -> None:
    """Ours and TransformerLens's FactoredMatrix on the same factors agree on every derived quantity."""
    ours, theirs = FactoredMatrix(A, B), tl_class(A, B)
    close(ours.BA, theirs.BA, "BA")
    close(ours.S, theirs.S, "singular values")
    U, S, V = ours.svd()
    close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), theirs.AB, "U S V^T")
    close(ours.collapse_r() @ ours.collapse_r().transpose(-2, -1), theirs.AB @ theirs.AB.transpose(-2, -1), "U S S U^T")
    close(ours.norm(), theirs.norm(), "norm")
    ours_eig, theirs_eig = sorted_eigenvalues(ours.eigenvalues), sorted_eigenvalues(theirs.eigenvalues)
    close(torch.view_as_real(ours_eig), torch.view_as_real(theirs_eig), "eigenvalues")
    close(ours.T.AB, theirs.T.AB, "T")
    close(ours.make_even().AB, theirs.AB, "make_even")
    for index in [(1,), (0, 2), (1, 0, slice(0, 5)), (0, 3, slice(2, 9), 4), (-1, -1, -1, -1)]:
        close(ours[index].AB, theirs[index].AB, f"[{index}]")
    vector, matrix = torch.randn(A.shape[-2]), torch.randn(A.shape[-2], 3)
    close(ours @ vector, theirs @ vector, "@ vector")
    close(vector @ ours, vector @ theirs, "vector @")
    close((ours @ matrix).AB, (theirs @ matrix).AB, "@ matrix")
    close((matrix.T @ ours).AB, (matrix.T @ theirs).AB, "matrix @")
    close((ours @ ours).AB, (theirs @ theirs).AB, "@ FactoredMatrix")
    close((2.5 * ours).AB, (2.5 * theirs).AB, "scalar *")
    close(ours.get_corner(4), theirs.get_corner(4), "get_corner")


@pytest.mark.parametrize("shape", ["qwen3", "llama"])
@torch.no_grad()
def test_text_is_tokenized_with_the_families_default_bos_as_tl_does(shape, tmp_path):
    """Issue 47: TransformerLens's Qwen2/Qwen3/GPT-NeoX adapters set default_prepend_bos=False, the others
    leave it True; HookedModel's text input follows the same default, so the loss of a text is TL's."""
    model, bridge = build_pair(shape, tmp_path / "hf")
    hooked = HookedModel(model, reference_tokenizer())
    assert bridge.cfg.default_prepend_bos is (shape != "qwen3")
    assert torch.equal(hooked.to_tokens(TEXTS[0]), bridge.to_tokens(TEXTS[0]))
    assert hooked.to_str_tokens(TEXTS[0]) == bridge.to_str_tokens(TEXTS[0])
    close(hooked(TEXTS[0], return_type="loss"), bridge(TEXTS[0], return_type="loss"), "loss of a text")
    close(hooked.run_with_cache(TEXTS[0])[0], bridge.run_with_cache(TEXTS[0])[0], "run_with_cache(text)")
    assert torch.equal(hooked.to_tokens(TEXTS[0], prepend_bos=True), bridge.to_tokens(TEXTS[0], prepend_bos=True))

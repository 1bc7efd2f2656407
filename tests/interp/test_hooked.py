"""TransformerLens's model interface on glasslm (HookedModel, text input, return_type, stop_at_layer,
FactoredMatrix) against closed forms and PyTorch's own ops; test_transformer_lens_api.py checks the same
calls against TransformerLens itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glasslm.core.model import TransformerLM
from glasslm.interp.factored import FactoredMatrix
from glasslm.interp.hooked import HookedModel
from glasslm.interp.hooks import run_with_cache, run_with_hooks
from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer

TEXT = "to be or not to be"


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")  # <|endoftext|> is its bos
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", n_layers=3, vocab_size=tok.vocab_size, context_length=24))
    return HookedModel.load(save_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", model, tok))


@torch.no_grad()
def test_text_input_is_the_bos_then_the_texts_tokens(hooked):
    tok = hooked.tokenizer
    expected = torch.tensor([[tok.special_tokens["<|endoftext|>"], *tok.encode(TEXT)]])
    assert torch.equal(hooked.to_tokens(TEXT), expected)
    assert torch.equal(hooked.to_tokens(TEXT, prepend_bos=False), expected[:, 1:])
    logits, cache = hooked.run_with_cache(TEXT, names_filter="blocks.2.hook_resid_post")
    torch.testing.assert_close(logits, hooked.model(expected))
    torch.testing.assert_close(run_with_hooks(hooked.model, TEXT, tokenizer=tok), logits)
    assert hooked.to_string(expected[0, 1:]) == TEXT and hooked.to_str_tokens(TEXT)[1:3] == ["t", "o"]
    assert hooked.to_tokens("a" * 40).shape == (1, 24)  # cut to the context, as TransformerLens truncates
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        run_with_cache(hooked.model, TEXT)


@torch.no_grad()
def test_return_types_are_the_logits_and_next_token_cross_entropy(hooked):
    tokens = hooked.to_tokens(["to be", "or not to"], prepend_bos=False)  # padded to one length
    logits = hooked.model(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    torch.testing.assert_close(hooked(tokens, return_type="loss"), loss.mean())
    torch.testing.assert_close(hooked(tokens, return_type="loss", loss_per_token=True), loss.view(2, -1))
    both = hooked(tokens, return_type="both")
    torch.testing.assert_close(both[0], logits)
    torch.testing.assert_close(both[1], loss.mean())
    assert hooked(tokens, return_type=None) is None
    with pytest.raises(ValueError, match="return_type must be one of"):
        hooked(tokens, return_type="probs")
    with pytest.raises(ValueError, match="at least two tokens"):
        hooked(tokens[:, :1], return_type="loss")


@torch.no_grad()
def test_stop_at_layer_returns_the_stream_entering_that_block(hooked):
    tokens = hooked.to_tokens(TEXT)
    _, cache = hooked.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_pre"))
    for layer in (0, 1, 2, -1, -3):
        torch.testing.assert_close(hooked(tokens, stop_at_layer=layer), cache["resid_pre", layer % 3])
    torch.testing.assert_close(hooked(tokens, stop_at_layer=3), hooked.model(tokens))  # no block 3: the logits
    fired = []
    resid, partial = hooked.run_with_cache(tokens, stop_at_layer=1,
                                           fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, n: fired.append(n))])
    assert not fired and sorted(name for name in partial if name.startswith("blocks.1")) == []
    torch.testing.assert_close(resid, partial["blocks.0.hook_resid_post"])
    with pytest.raises(ValueError, match=r"stop_at_layer must be in \[-3, 3\]"):
        hooked(tokens, stop_at_layer=4)
    assert not any(m._forward_hooks for m in hooked.model.modules())  # the stop hook is gone too


@torch.no_grad()
def test_remove_batch_dim_drops_the_axis_and_keeps_the_methods(hooked):
    tokens = hooked.to_tokens(TEXT)
    _, batched = hooked.run_with_cache(tokens)
    _, single = hooked.run_with_cache(tokens, remove_batch_dim=True)
    assert all(torch.equal(single[name], batched[name][0]) for name in batched)
    torch.testing.assert_close(single.decompose_resid(apply_ln=True), batched.decompose_resid(apply_ln=True)[:, 0])
    torch.testing.assert_close(single.stack_head_results(), batched.stack_head_results()[:, 0])
    assert single.stack_activation("pattern").shape == (3, 8, tokens.shape[1], tokens.shape[1])
    with pytest.raises(ValueError, match="batch of one"):
        hooked.run_with_cache(torch.cat([tokens, tokens]), remove_batch_dim=True)


def test_stacked_weights_are_the_models_own_and_circuits_their_products(hooked):
    model, c = hooked.model, hooked.model.config
    attn = model.blocks[1].attn
    q_rows = attn.qkv.weight[:c.n_heads * c.d_head].view(c.n_heads, c.d_head, c.d_model)
    assert torch.equal(hooked.W_Q[1], q_rows.transpose(1, 2)) and hooked.W_K.shape == (3, c.n_kv_heads, c.d_model, c.d_head)
    head = 5  # a query head of the second key/value group
    w_v = hooked.W_V[1, head // (c.n_heads // c.n_kv_heads)]
    torch.testing.assert_close(hooked.OV[1, head].AB, w_v @ hooked.W_O[1, head])
    assert torch.equal(hooked.W_U, model.unembed.weight.T) and not hooked.b_U.any() and hooked.W_gate is not None
    with pytest.raises(ValueError, match="rope"):
        hooked.W_pos


def test_factored_matrix_against_its_product():
    torch.manual_seed(0)
    A, B = torch.randn(3, 10, 4, dtype=torch.float64), torch.randn(3, 4, 7, dtype=torch.float64)
    m, product = FactoredMatrix(A, B), A @ B
    U, S, V = m.svd()
    torch.testing.assert_close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), product)
    torch.testing.assert_close(S, torch.linalg.svdvals(product)[..., :4])
    torch.testing.assert_close(U.transpose(-2, -1) @ U, torch.eye(4, dtype=torch.float64).expand(3, 4, 4))
    torch.testing.assert_close(m.norm(), torch.linalg.matrix_norm(product))
    torch.testing.assert_close(m[1, 2:5, 3].AB, product[1, 2:5, 3:4])
    torch.testing.assert_close(m.T.AB, product.transpose(-2, -1))
    x = torch.randn(7, dtype=torch.float64)
    torch.testing.assert_close(m @ x, product @ x)
    square = FactoredMatrix(torch.randn(6, 3, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64))
    eig = torch.linalg.eigvals(square.AB)
    nonzero = eig[eig.abs() > 1e-9]
    assert sorted(nonzero.abs().tolist()) == pytest.approx(sorted(square.eigenvalues.abs().tolist()))
    with pytest.raises(ValueError, match="inner dimension"):
        FactoredMatrix(A, B.transpose(-2, -1))
    with pytest.raises(ValueError, match="square"):
        m.BA

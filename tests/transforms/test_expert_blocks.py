"""The expert_blocks transform (transforms/experts.py): a mixture of experts' stacked matrices in
llama.cpp's blocks, read one expert at a time, saved and loaded by checkpoints, refused by name where
it cannot apply."""

from __future__ import annotations

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import load_checkpoint, save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers.char import CharTokenizer
from glasslm.transforms import apply_transform, parameter_count
from glasslm.transforms.experts import ExpertBlocks
from glasslm.transforms.ggml import dequantize_blocks, quantize_blocks


def moe_model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_preset("llama-tiny", vocab_size=64, n_layers=2, d_model=64, n_heads=4, d_mlp=96,
                                    context_length=16, n_experts=4, experts_per_token=2)).eval()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1", "f16"])
def test_each_expert_is_its_rows_of_the_file_blocks(qtype):
    model = moe_model()
    floats = model.blocks[1].mlp.up.detach().clone()  # (4, 96, 64)
    count = parameter_count(model)
    apply_transform(model, "expert_blocks", qtype=qtype)
    up = model.blocks[1].mlp.up
    assert isinstance(up, ExpertBlocks) and up.shape == floats.shape and parameter_count(model) == count
    # The blocks are the whole stacked matrix quantized row by row, as llama.cpp's ffn_up_exps holds it.
    assert torch.equal(up.blocks(), quantize_blocks(floats.reshape(-1, 64), qtype))
    x = torch.randn(3, 64)
    for e in range(4):
        exact = dequantize_blocks(quantize_blocks(floats[e], qtype), qtype)
        assert torch.equal(up[e], exact)
        torch.testing.assert_close(up.expert(e, x), x @ exact.T, rtol=0, atol=2e-3 * (x @ exact.T).abs().max().item())


def test_a_checkpoint_keeps_the_experts_in_their_blocks(tmp_path):
    model = moe_model()
    apply_transform(model, "expert_blocks", qtype="q8_0")
    tokens = torch.tensor([[1, 2, 3, 4]])
    path = save_checkpoint(tmp_path / "ckpt", model, CharTokenizer.from_text("abc"), {})
    loaded, _, _ = load_checkpoint(path)
    assert isinstance(loaded.blocks[0].mlp.gate, ExpertBlocks)
    assert torch.equal(loaded.blocks[0].mlp.gate.blocks(), model.blocks[0].mlp.gate.blocks())
    assert torch.equal(loaded(tokens), model(tokens))


def test_what_cannot_apply_is_refused_by_name():
    with pytest.raises(ValueError, match="has no mixture-of-experts layers"):
        apply_transform(TransformerLM(get_preset("llama-tiny")), "expert_blocks")
    with pytest.raises(ValueError, match="qtype 'q3_k' unknown"):
        apply_transform(moe_model(), "expert_blocks", qtype="q3_k")
    with pytest.raises(ValueError, match="glasslm cannot write q4_k blocks"):
        apply_transform(moe_model(), "expert_blocks", qtype="q4_k")
    with pytest.raises(ValueError, match=r"layers \['blocks.0.attn.qkv'\] are not experts' projections"):
        apply_transform(moe_model(), "expert_blocks", layers={"blocks.0.attn.qkv": "q8_0"})

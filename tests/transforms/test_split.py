"""row_split: a fused Linear kept as parts by output rows computes what the fused layer computes,
each part takes its own block format, and a checkpoint of it loads back (what a mixed GGUF file needs)."""

from __future__ import annotations

import pytest
import torch

from glasslm.core.layers import Linear
from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import load_checkpoint, save_checkpoint
from glasslm.presets import get_preset
from glasslm.transforms import applied_transforms, apply_transform
from glasslm.transforms.ggml import BlockLinear
from glasslm.transforms.split import RowSplitLinear


def test_a_split_layer_is_the_fused_layer_side_by_side():
    torch.manual_seed(0)
    fused = Linear(16, 10)
    with torch.no_grad():
        fused.bias.normal_()  # not zeros: a bias cut at the wrong row shows
    split = RowSplitLinear.from_linear(fused, [6, 3, 1])
    x = torch.randn(2, 5, 16)
    # (Products of 6, 3 and 1 rows may add in another order than one of 10: float rounding apart.)
    torch.testing.assert_close(split(x), torch.nn.functional.linear(x, fused.weight, fused.bias))
    assert torch.equal(split.weight, fused.weight) and torch.equal(split.bias, fused.bias)
    with pytest.raises(ValueError, match=r"parts of \[6, 3\] rows do not add up to the layer's 10"):
        RowSplitLinear.from_linear(fused, [6, 3])


def test_parts_take_their_own_formats_and_a_checkpoint_reloads_them(tmp_path):
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", d_mlp=352)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    before = model(ids)
    qkv_rows = model.blocks[0].attn.qkv.weight.shape[0]
    apply_transform(model, "row_split", layers={"blocks.0.attn.qkv": [qkv_rows - 32, 32]})
    assert torch.allclose(model(ids), before, atol=1e-5)  # (the same products, concatenated)
    apply_transform(model, "q5_1", layers=["blocks.0.attn.qkv.parts.0"])
    apply_transform(model, "q8_0", layers=["blocks.0.attn.qkv.parts.1"])
    parts = model.blocks[0].attn.qkv.parts
    assert [type(p).__name__ for p in parts] == ["BlockLinear", "BlockLinear"] and parts[1].qtype == "q8_0"
    after = model(ids)
    assert 0 < (after - before).abs().max() < 0.1 * before.abs().max()
    save_checkpoint(tmp_path / "split", model)
    back, _, meta = load_checkpoint(tmp_path / "split")
    assert meta["transforms"] == applied_transforms(model) == applied_transforms(back)
    assert meta["transforms"][0] == {"name": "row_split", "layers": {"blocks.0.attn.qkv": [qkv_rows - 32, 32]}}
    assert isinstance(back.blocks[0].attn.qkv.parts[0], BlockLinear) and torch.equal(back(ids), after)


def test_only_linear_layers_split():
    model = TransformerLM(get_preset("llama-tiny"))
    with pytest.raises(ValueError, match="blocks.0.ln1 is not a Linear layer"):
        apply_transform(model, "row_split", layers={"blocks.0.ln1": [1]})
    with pytest.raises(ValueError, match="at least one row"):
        RowSplitLinear(8, [4, 0])

"""Mixture-of-experts models as GGUF files: Mixtral (llama.cpp's "llama" with experts), Qwen3-MoE
(qwen3moe), Qwen2-MoE (qwen2moe) and OLMoE (olmoe) exported, run by llama.cpp itself to our logits, read back
unchanged; a file llama.cpp's quantizer wrote reads with its expert tensors kept in their blocks;
what llama.cpp cannot run is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp")

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.hf import UnsupportedModelError, family_of  # noqa: E402
from glasslm.hf.families.common import computed_fields  # noqa: E402
from glasslm.hf.gguf.exporter import export_gguf  # noqa: E402
from glasslm.hf.gguf.importer import import_gguf  # noqa: E402
from glasslm.hf.gguf.reader import GGUFFile  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from tests.hf.test_gguf import bpe  # noqa: E402,F401 (the shared fixture)
from tests.llamacpp import llama_cpp_quantize, quiet_llama  # noqa: E402
from tests.moe_models import perturbed_moe  # noqa: E402

_SMALL = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_mlp=96, context_length=128, n_experts=4,
              experts_per_token=2)
CONFIGS = {
    "mixtral": lambda v: get_preset("llama-tiny", vocab_size=v, **_SMALL),
    "qwen3_moe": lambda v: get_preset("llama-tiny", vocab_size=v, **_SMALL, qk_norm=True, d_head=32, d_expert=48),
    "qwen2_moe": lambda v: get_preset("llama-tiny", vocab_size=v, **_SMALL, attn_qkv_bias=True, d_expert=48,
                                      d_shared_expert=80, router_renormalize=False),
    "olmoe": lambda v: get_preset("llama-tiny", vocab_size=v, **{**_SMALL, "n_kv_heads": 4}, qk_norm=True,
                                  qk_norm_whole=True, router_renormalize=False),  # (llama.cpp's: no grouped heads)
}
ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe"}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_llama_cpp_runs_our_moe_file_as_our_model_and_it_reads_back_unchanged(family, bpe, shakespeare_text, tmp_path):
    model = perturbed_moe(CONFIGS[family](bpe.vocab_size))
    assert family_of(model.config) == family
    path = export_gguf(model, tmp_path / "m.gguf", bpe, "f32")
    file = GGUFFile.open(path)
    assert file.arch == ARCH[family] and file.metadata[f"{file.arch}.expert_count"] == 4
    assert file.shape("blk.0.ffn_gate_exps.weight") == (4, model.config.d_expert or 96, 64)  # one 3-D tensor
    ids = bpe.encode(shakespeare_text[:400])[:40]
    theirs = quiet_llama(path, logits_all=True).logits(ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].numpy()
    print(f"{family}: max |logit diff| {np.abs(ours - theirs).max():.2e} of {np.abs(theirs).max():.2f}")
    assert np.abs(ours - theirs).max() < 1e-4 * np.abs(theirs).max()  # the dense families' tolerance
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    loaded = import_gguf(path)
    assert loaded.family == family and computed_fields(loaded.model.config) == computed_fields(model.config)
    # Read as floats, the same logits exactly; with the f32 matrices (experts too) kept in the kernels'
    # panels, the same to float32 summation order.
    x = torch.tensor([ids])
    assert torch.equal(import_gguf(path, keep_blocks=False).model(x), model(x))
    assert (loaded.model(x) - model(x)).abs().max() <= 1e-5 * model(x).abs().max()


def test_a_file_llama_cpps_quantizer_wrote_reads_with_its_experts_kept_in_their_blocks(bpe, shakespeare_text, tmp_path):
    model = perturbed_moe(CONFIGS["qwen3_moe"](bpe.vocab_size).replace(d_model=256, d_expert=256, n_heads=4, d_head=64))
    export_gguf(model, tmp_path / "f32.gguf", bpe, "f32")
    llama_cpp_quantize(tmp_path / "f32.gguf", tmp_path / "q8.gguf", "q8_0")
    file, loaded = GGUFFile.open(tmp_path / "q8.gguf"), import_gguf(tmp_path / "q8.gguf")
    assert file.qtype("blk.1.ffn_down_exps.weight") == "q8_0"
    assert loaded.kept["q8_0 (experts)"] == 6 and "q8_0" not in loaded.dequantized  # three a layer, as the file's blocks
    down = loaded.model.blocks[1].mlp.down
    assert type(down).__name__ == "ExpertBlocks" and down.qtype == "q8_0" and down.expert_matrices() is not None
    assert "6 q8_0 (experts)" in loaded.summary()
    # The same numbers as the gguf package's dequantization, and the file's bytes back exactly.
    torch.testing.assert_close(down.weight, file.dequantized("blk.1.ffn_down_exps.weight"), rtol=0, atol=0)
    assert torch.equal(down.blocks(), file.blocks("blk.1.ffn_down_exps.weight").reshape(down.d_out, -1))
    # Written out again as f32 (the experts dequantized under their parameter's name): the same float model.
    again = export_gguf(loaded.model, tmp_path / "again.gguf", bpe, "f32")
    x = torch.tensor([bpe.encode(shakespeare_text[:100])[:16]])
    assert torch.equal(import_gguf(again, keep_blocks=False).model(x), import_gguf(tmp_path / "q8.gguf", keep_blocks=False).model(x))
    ids = bpe.encode(shakespeare_text[:300])[:32]
    theirs = quiet_llama(tmp_path / "q8.gguf", logits_all=True).logits(ids)
    with torch.no_grad():
        ours = loaded.model(torch.tensor([ids]))[0].numpy()
    # llama.cpp rounds activations to 8 bits for its q8_0 dot products (tests/hf/test_gguf_llamacpp.py: 2-3%
    # of the largest logit on dense models).
    gaps, scale = np.abs(ours - theirs).max(axis=-1), np.abs(ours).max()
    print(f"largest logit gap per position, over the largest logit: median {np.median(gaps) / scale:.4f}, "
          f"max {gaps.max() / scale:.4f}")
    assert np.median(gaps) < 0.02 * scale
    # Here and there a token whose two best experts are close is routed otherwise by llama.cpp's rounded
    # activations (one of these 32: 5.6%); most positions are as close as a dense model's.
    assert (gaps > 0.03 * scale).mean() < 0.1


@pytest.mark.parametrize("family, changes, message", [
    ("qwen3_moe", dict(moe_every=2), "llama.cpp's qwen3moe has experts on every layer; this model has them every 2"),
    ("qwen3_moe", dict(router_renormalize=False), "llama.cpp's qwen3moe renormalises"),
    ("qwen2_moe", dict(router_renormalize=True), "llama.cpp's qwen2moe does not renormalise"),
    ("mixtral", dict(sliding_window=8), "no sliding window"),
    ("olmoe", dict(router_renormalize=True), "llama.cpp's olmoe does not renormalise"),
    ("olmoe", dict(n_kv_heads=2), "llama.cpp's olmoe has a key norm as wide as the embedding"),
])
def test_what_llama_cpp_cannot_run_is_refused_by_name(family, changes, message, tmp_path):
    model = TransformerLM(CONFIGS[family](64).replace(**changes))
    with pytest.raises(UnsupportedModelError, match=message):
        export_gguf(model, tmp_path / "m.gguf", None, "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_a_file_with_experts_is_never_read_as_a_dense_model(bpe, tmp_path):
    """An expert count on an architecture glasslm reads only dense (qwen2 with experts) is refused by name."""
    import gguf

    dense = export_gguf(TransformerLM(get_preset("llama-tiny", vocab_size=bpe.vocab_size, attn_qkv_bias=True,
                                                 n_kv_heads=2)), tmp_path / "dense.gguf", bpe, "f32")
    reader = gguf.GGUFReader(dense)
    writer = gguf.GGUFWriter(tmp_path / "experts.gguf", "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    writer.add_uint32("qwen2.expert_count", 4)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'qwen2' with experts is not supported"):
        import_gguf(tmp_path / "experts.gguf")

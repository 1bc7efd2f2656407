"""llama.cpp itself reads glasslm's GGUF files as the same model, and tokenizes as glasslm's readers do."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp")

from glasslm.hf.gguf.exporter import export_gguf  # noqa: E402
from glasslm.hf.gguf.reader import GGUFFile  # noqa: E402
from glasslm.tokenizers.gguf import tokenizer_from_gguf  # noqa: E402
from tests.hf.test_gguf import FAMILY_CONFIGS, bpe, perturbed  # noqa: E402,F401 (bpe: the shared fixture)
from tests.llamacpp import llama_cpp_quantize, quiet_llama  # noqa: E402


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_llama_cpp_computes_our_logits_from_our_file(family, bpe, shakespeare_text, tmp_path):
    model = perturbed(FAMILY_CONFIGS[family](bpe.vocab_size))
    path = export_gguf(model, tmp_path / "m.gguf", bpe, "f32")
    text = shakespeare_text[:400]
    ids = bpe.encode(text)[:40]
    llm = quiet_llama(path, logits_all=True)
    assert llm.tokenize(text.encode(), add_bos=False, special=True)[:40] == ids
    theirs = llm.logits(ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].numpy()
    # Both in float32 throughout, summed in other orders (~1e-5 relative); but ggml's GELU reads a
    # table of fp16 values (GGML_GELU_FP16), which moves GELU models' logits by ~4e-4 relative.
    tolerance = 2e-3 if model.config.activation.startswith("gelu") else 1e-4
    assert np.abs(ours - theirs).max() < tolerance * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def spm_model(text: str) -> bytes:
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=model, vocab_size=600,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2)
    return model.getvalue()


PROBES = ["Hello  world!\n\nnaïve café 東京 123", " leading space", "ÿ unknown chars ☃", "<s>x</s> y", "a\tb\n  c", ""]


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(shakespeare_text, tmp_path):
    from glasslm.presets import get_preset
    from glasslm.tokenizers import SentencePieceTokenizer

    sp = SentencePieceTokenizer(spm_model(shakespeare_text[:200_000]), {"bos_token": "<s>", "eos_token": "</s>"})
    model = perturbed(get_preset("llama-tiny", vocab_size=sp.vocab_size))
    path = export_gguf(model, tmp_path / "s.gguf", sp, "f32")
    ours = tokenizer_from_gguf(GGUFFile.open(path).metadata)
    llm = quiet_llama(path, vocab_only=True)
    for text in [shakespeare_text[:5000], *PROBES]:
        # (special=True: glasslm's encode turns special tokens written in the text into their ids)
        assert ours.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text
    # SentencePiece itself collapses runs of spaces and folds newlines; llama.cpp (and so the GGUF
    # reader) keeps them: the two differ on purpose.
    assert ours.encode("a  b") != sp.encode("a  b")


@pytest.mark.parametrize("ftype", ["q4_1", "q4_0", "q5_0", "q4_k_m"])
def test_files_llama_cpps_quantizer_wrote_read_as_llama_cpp_runs_them(ftype, bpe, shakespeare_text, tmp_path):
    from glasslm.hf.gguf.importer import import_gguf
    from glasslm.presets import get_preset
    from glasslm.transforms.ggml import BlockLinear

    # Rows of 256: the K-quants' super-blocks need them (a narrower matrix falls back to another type).
    model = perturbed(get_preset("llama-tiny", vocab_size=bpe.vocab_size, d_model=256, n_heads=4, d_mlp=512))
    export_gguf(model, tmp_path / "f32.gguf", bpe, "f32")
    llama_cpp_quantize(tmp_path / "f32.gguf", tmp_path / f"{ftype}.gguf", ftype)
    file, loaded = GGUFFile.open(tmp_path / f"{ftype}.gguf"), import_gguf(tmp_path / f"{ftype}.gguf")
    types = {file.qtype(name) for name in file.tensor_names()}
    if ftype in ("q4_0", "q4_1"):
        # Kept as llama.cpp wrote them; and glasslm's own quantizer writes the same bytes from the f32 file.
        assert loaded.kept[ftype] > 0 and isinstance(loaded.model.blocks[0].mlp.up, BlockLinear)
        ours = GGUFFile.open(export_gguf(model, tmp_path / "ours.gguf", bpe, ftype))
        assert torch.equal(ours.blocks("blk.1.ffn_up.weight"), file.blocks("blk.1.ffn_up.weight"))
    else:
        assert types - {"f32"} and not loaded.kept  # every quantized tensor dequantized (Q5_0, K-quants)
    for module in loaded.model.modules():
        if hasattr(module, "impl"):
            module.impl = "readable"  # the file's values exactly
    ids = bpe.encode(shakespeare_text[:300])[:32]
    theirs = quiet_llama(tmp_path / f"{ftype}.gguf", logits_all=True).logits(ids)
    with torch.no_grad():
        ours_logits = loaded.model(torch.tensor([ids]))[0].numpy()
    # The same quantized weights; llama.cpp also rounds activations to 8 bits for its dot products
    # (q8_0/q8_1/q8_K), which moves the largest logit difference to 2-3% of the largest logit here.
    assert np.abs(ours_logits - theirs).max() < 0.05 * np.abs(theirs).max()
    assert (ours_logits.argmax(-1) == theirs.argmax(-1)).mean() > 0.9

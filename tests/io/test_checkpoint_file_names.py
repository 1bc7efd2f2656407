"""A glasslm checkpoint keeps its own formats under its own file names, so a Hugging Face loader
pointed at it reads only files in HF's formats: `transformers.AutoTokenizer.from_pretrained(checkpoint)`
(what lm-eval's `tokenizer=` does) gives a tokenizer that encodes and decodes as glasslm's does, for a
char and a BPE checkpoint alike. Checkpoints written before (glasslm's config and a char tokenizer
under HF's `config.json` and `tokenizer.json`) keep loading, and are saved in the new names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import CONFIG_FILE, load_checkpoint, save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer, load_tokenizer, train_tokenizer_from_text

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

FIXTURES = Path(__file__).parents[1] / "fixtures" / "v0_1_0"
TEXTS = ["hello world", "the cat<|endoftext|>sat\n\non the mat", "", "  hello<|endoftext|><|endoftext|>"]
TOKENIZERS = {"char": lambda: CharTokenizer.from_text("hello world, the cat sat on the mat\n"),
              "bpe": lambda: train_tokenizer_from_text("hello world, the cat sat on the mat\n" * 20, vocab_size=280)}


def _checkpoint(kind, directory):
    tokenizer = TOKENIZERS[kind]()
    model = TransformerLM(get_preset("llama-tiny", vocab_size=tokenizer.vocab_size, n_layers=1))
    return save_checkpoint(directory, model, tokenizer), tokenizer


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_files_under_hugging_faces_names_are_in_hugging_faces_formats(kind, tmp_path):
    path, _ = _checkpoint(kind, tmp_path / "ckpt")
    assert not (path / "config.json").exists() and (path / CONFIG_FILE).is_file()
    tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))  # HF's own reader takes it
    assert "tokenizer_class" in json.loads((path / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_autotokenizer_reads_a_checkpoint_as_glasslm_does(kind, tmp_path):
    path, ours = _checkpoint(kind, tmp_path / "ckpt")
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    assert isinstance(load_tokenizer(path), type(ours))  # glasslm still reads its own descriptor
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == ours.decode(ids) == text
    assert theirs.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("name", ["char-run-step3", "char-int8"])
def test_an_old_checkpoint_loads_and_saves_in_the_new_names(name, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(FIXTURES / name, old)
    assert (old / "config.json").is_file() and json.loads((old / "tokenizer.json").read_text())["kind"] == "char"
    model, tokenizer, _ = load_checkpoint(old)
    assert isinstance(tokenizer, CharTokenizer)
    again = save_checkpoint(tmp_path / "again", model, tokenizer)
    assert not (again / "config.json").exists()
    model2, tokenizer2, _ = load_checkpoint(again)
    ids = torch.tensor([tokenizer.encode("First Citizen")])
    assert tokenizer2.chars == tokenizer.chars and tokenizer2.special_tokens == tokenizer.special_tokens
    with torch.no_grad():
        assert torch.equal(model2(ids), model(ids))
    assert transformers.AutoTokenizer.from_pretrained(again)("First Citizen")["input_ids"] == ids[0].tolist()

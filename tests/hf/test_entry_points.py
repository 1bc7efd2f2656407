"""Every way of loading a Hugging Face model gives the same model: `glasslm.import_hf(dir)`,
`glasslm.load_model(dir)`, and a checkpoint made by `glasslm convert --from-hf` read back with
`load_checkpoint` or `load_model`, and that checkpoint exported again with `--to-hf`, all stop
generating at the same eos ids, hold the same tokenizer and compute the same logits. The model is a
tiny Llama saved by transformers whose generation_config.json lists two eos ids where its tokenizer
names one (tests/chat_models.py); a second copy has no generation_config.json and a config.json eos
that is not the tokenizer's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import glasslm
from glasslm.cli import main
from glasslm.generation import generate_tokens
from glasslm.hf import hf_tokenizer

pytest.importorskip("transformers")

TEXTS = ["hello there", "<|user|>hi</s><|assistant|>", ""]


def _loaded_every_way(directory, tmp_path):
    """{entry point: (model, tokenizer)}; import_hf's tokenizer is what a user reads beside it."""
    converted = tmp_path / "converted"
    assert main(["convert", "--from-hf", str(directory), "--out", str(converted)]) == 0
    assert main(["convert", "--to-hf", "--checkpoint", str(converted), "--out", str(tmp_path / "exported")]) == 0
    from_checkpoint, checkpoint_tokenizer, _ = glasslm.load_checkpoint(converted)
    return {"import_hf": (glasslm.import_hf(directory), hf_tokenizer(directory)),
            "load_model": glasslm.load_model(directory),
            "load_checkpoint(converted)": (from_checkpoint, checkpoint_tokenizer),
            "load_model(converted)": glasslm.load_model(converted),
            "load_model(converted, then --to-hf)": glasslm.load_model(tmp_path / "exported")}


def _assert_same_models(loaded, expected_eos):
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    reference_logits = None
    for route, (model, tokenizer) in loaded.items():
        assert tuple(model.eos_token_ids) == expected_eos, route
        assert [tokenizer.encode(t) for t in TEXTS] == [loaded["load_model"][1].encode(t) for t in TEXTS], route
        assert tokenizer.special_tokens == loaded["load_model"][1].special_tokens, route
        with torch.no_grad():
            logits = model.eval()(ids)
        reference_logits = logits if reference_logits is None else reference_logits
        assert torch.equal(logits, reference_logits), route


def test_every_entry_point_stops_at_generation_configs_eos_ids(llama_chat, tmp_path):
    directory, _, hf_tok = llama_chat
    assert hf_tok.eos_token_id == 2  # the tokenizer names one eos; generation_config.json lists two
    _assert_same_models(_loaded_every_way(directory, tmp_path), (2, 3))


def test_without_generation_config_every_entry_point_takes_config_jsons_eos(llama_chat, tmp_path):
    directory = tmp_path / "no-generation-config"
    shutil.copytree(llama_chat[0], directory)
    (directory / "generation_config.json").unlink()
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": 3}))  # not the tokenizer's 2
    (tmp_path / "out").mkdir()
    _assert_same_models(_loaded_every_way(directory, tmp_path / "out"), (3,))


def test_import_hf_generation_stops_where_transformers_stops(llama_chat):
    directory, hf_model, hf_tok = llama_chat
    model, prompt = glasslm.import_hf(directory), hf_tok.encode("hello there", add_special_tokens=False)
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    assert theirs[-1] in (2, 3) and len(theirs) < 16  # transformers stopped at an eos
    assert list(generate_tokens(model, prompt, max_new_tokens=16, temperature=0.0)) == theirs[:-1]

"""A PEFT adapter directory from the command line, as a peft user has one (adapter_config.json naming
its base, adapter_model.safetensors with trained DoRA values and a trained lm_head):

    glasslm generate --checkpoint ADAPTER ...                  # its base + the adapter, as AutoPeftModel loads it
    glasslm convert --from-peft ADAPTER [--base BASE] --out DIR   # a glasslm adapter checkpoint
    glasslm merge --checkpoint ADAPTER --out DIR --to-hf       # peft's merge_and_unload, for transformers
    glasslm convert --to-peft --checkpoint DIR --out ADAPTER2  # and back

Each gives peft's greedy text or logits. The commands in docs/interop.md's PEFT section are these.
"""

from __future__ import annotations

import json

import pytest
import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.hf import export_hf, load_model
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOKENIZER = CharTokenizer.from_text("abcdefgh ijklmnop\n")
PROMPT = "abc de"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(base directory, adapter directory, the peft model) for a DoRA adapter with a trained lm_head."""
    root = tmp_path_factory.mktemp("peft-cli")
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=TOKENIZER.vocab_size, context_length=64, n_layers=2))
    export_hf(model.eval(), root / "base", TOKENIZER)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True,
                             modules_to_save=["lm_head"], init_lora_weights=False)
    peft_model = peft.get_peft_model(hf_model, config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                scale = 0.3 * p.abs().mean() if "magnitude" in name else 0.3
                p.add_(torch.randn(p.shape, generator=generator) * scale)
    peft_model.save_pretrained(root / "adapter")
    assert json.loads((root / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        root / "base")
    return root / "base", root / "adapter", peft_model


def _peft_greedy(peft_model, n=10):
    ids = torch.tensor([TOKENIZER.encode(PROMPT)])
    out = peft_model.generate(input_ids=ids, max_new_tokens=n, do_sample=False)
    return PROMPT + TOKENIZER.decode(out[0, ids.shape[1]:].tolist()).removesuffix("<|endoftext|>")


def _generate(checkpoint, capsys):
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", "10"]) == 0
    return capsys.readouterr().out.rstrip("\n")


def _logits(peft_or_hf_model):
    with torch.no_grad():
        return peft_or_hf_model(torch.tensor([TOKENIZER.encode(PROMPT)])).logits


def test_generate_takes_a_peft_adapter_directory_as_checkpoint(adapter, capsys):
    _, directory, peft_model = adapter
    assert _generate(directory, capsys) == _peft_greedy(peft_model)
    model, _ = load_model(directory)
    with torch.no_grad():
        ours = model(torch.tensor([TOKENIZER.encode(PROMPT)]))
    assert (ours - _logits(peft_model)).abs().max() <= 2e-5 * max(1.0, ours.abs().max().item())


def test_convert_from_peft_writes_an_adapter_checkpoint_that_converts_back(adapter, tmp_path, capsys):
    _, directory, peft_model = adapter
    assert main(["convert", "--from-peft", str(directory), "--out", str(tmp_path / "ckpt")]) == 0
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["adapter_of"]["path"] == str(adapter[0])
    capsys.readouterr()
    assert _generate(tmp_path / "ckpt", capsys) == _peft_greedy(peft_model)
    assert main(["convert", "--to-peft", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "again")]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(adapter[0], dtype=torch.float32)
    again = peft.PeftModel.from_pretrained(hf_model, tmp_path / "again").eval()
    theirs = _logits(peft_model)
    assert (_logits(again) - theirs).abs().max() <= 2e-5 * max(1.0, theirs.abs().max().item())


def test_merge_of_a_peft_adapter_directory_is_a_model_transformers_loads(adapter, tmp_path):
    _, directory, peft_model = adapter
    assert main(["merge", "--checkpoint", str(directory), "--out", str(tmp_path / "merged"), "--to-hf"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    theirs = _logits(peft_model)
    assert (_logits(merged) - theirs).abs().max() <= 1e-4 * max(1.0, theirs.abs().max().item())


def test_a_base_that_is_not_here_names_the_way_to_give_it(adapter, tmp_path, capsys):
    import shutil

    base, directory, peft_model = adapter
    moved = tmp_path / "adapter"
    shutil.copytree(directory, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/base"}))
    assert main(["generate", "--checkpoint", str(moved), "--prompt", PROMPT]) == 1
    err = capsys.readouterr().err
    assert "PEFT adapter for the base /gone/base" in err and f"convert --from-peft {moved} --base PATH" in err
    assert main(["convert", "--from-peft", str(moved), "--base", str(base), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert _generate(tmp_path / "ckpt", capsys) == _peft_greedy(peft_model)
    assert main(["convert", "--from-hf", str(moved), "--out", str(tmp_path / "x")]) == 1
    assert "is a PEFT adapter directory: convert it with --from-peft" in capsys.readouterr().err


def test_chat_and_serve_take_the_template_beside_the_adapter_else_the_bases(adapter, tmp_path):
    import shutil

    from glasslm.hf import load_chat_template

    base, directory, _ = adapter
    shutil.copytree(base, tmp_path / "base")
    (tmp_path / "base" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    shutil.copytree(directory, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path / "adapter", None) == "{{ messages[0]['content'] }}"
    (tmp_path / "adapter" / "chat_template.jinja").write_text("{{ 'mine' }}")
    assert load_chat_template(tmp_path / "adapter", None) == "{{ 'mine' }}"

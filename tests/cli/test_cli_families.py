"""The commands on a tiny converted model of each new family (Pythia / GPT-NeoX, Qwen3, Gemma 3):
exported with the GPT-2 tokenizer, `convert --from-hf`, then `info`, `generate`, `eval`, `inspect`,
`quantize` and the `serve` app, which all see the same model; hooks carry the same names in every
family.
"""

from __future__ import annotations

import json

import pytest
import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.hf import export_hf, load_model
from glasslm.presets import get_preset

TINY = dict(vocab_size=50257, context_length=64, d_model=32, n_layers=2, n_heads=4, d_mlp=48)
FAMILIES = {
    "gpt_neox": get_preset("pythia-160m", **TINY, rotary_dims=4),
    "qwen3": get_preset("qwen3-0.6b", **TINY, n_kv_heads=2, d_head=8),
    "gemma3_text": get_preset("gemma3-270m", **TINY, n_kv_heads=1, d_head=8, sliding_window=4, global_layers=(1,),
                              attn_scale=0.25),
}


def _tiny_model(config):
    torch.manual_seed(0)
    model = TransformerLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_commands_on_a_converted_model(family, tmp_path, data_dir, capsys, monkeypatch):
    from glasslm.tokenizers import gpt2_tokenizer, special_token_ids

    tokenizer = gpt2_tokenizer(data_dir)
    roles = special_token_ids(tokenizer)
    model = _tiny_model(FAMILIES[family])
    export_hf(model, tmp_path / "hf", tokenizer)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == family and hf_config["eos_token_id"] == roles["eos"] is not None
    ckpt, text = tmp_path / "ckpt", tmp_path / "text.txt"
    text.write_text("First Citizen: Before we proceed any further, hear me speak.\n" * 20)
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(ckpt)]) == 0
    loaded, loaded_tokenizer = load_model(ckpt)
    tokens = torch.tensor([tokenizer.encode("Hello there")])
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)
    assert loaded_tokenizer.encode("Hello there") == tokenizer.encode("Hello there")
    assert special_token_ids(loaded_tokenizer) == roles  # special ids carried both ways
    capsys.readouterr()

    assert main(["info", "--checkpoint", str(ckpt)]) == 0
    assert "blocks.*.attn" in capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "Hello", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("Hello")
    assert main(["eval", "--checkpoint", str(ckpt), "--data", str(text), "--split", "train", "--quiet"]) == 0
    assert "loss" in capsys.readouterr().out.lower()
    for view in (["attention", "--layer", "1", "--head", "0"], ["logit-lens"]):
        out = tmp_path / f"{view[0]}.png"
        assert main(["inspect", *view, "--checkpoint", str(ckpt), "--prompt", "Hello there", "--out", str(out)]) == 0
        assert out.stat().st_size > 0
    assert main(["quantize", "--checkpoint", str(ckpt), "--out", str(tmp_path / "q8")]) == 0
    assert main(["generate", "--checkpoint", str(tmp_path / "q8"), "--prompt", "Hello", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    _serve_completes(ckpt, monkeypatch)


def _serve_completes(ckpt, monkeypatch):
    """`glasslm serve` builds its app from the checkpoint: ask it for a completion in-process."""
    from fastapi.testclient import TestClient

    import glasslm.serving.server as server
    from glasslm.serving.app import create_app

    served = {}
    monkeypatch.setattr(server, "serve", lambda model, tok, config, chat_template=None, metrics_file=None: served.update(
        app=create_app(model, tok, config, chat_template=chat_template)))
    assert main(["serve", "--checkpoint", str(ckpt)]) == 0
    with TestClient(served["app"]) as client:
        reply = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_hooks_are_named_alike_in_every_family():
    names = {family: {n for n, _ in _tiny_model(fields).named_modules() if n.split(".")[-1].startswith("hook_")}
             for family, fields in FAMILIES.items()}
    common = set.intersection(*names.values())
    for family, hooks in names.items():
        # Every family has the shared per-block hooks; extra ones are its own norms' (q/k, post-norms)
        # and a gated MLP's second input projection (TransformerLens's hook_pre_linear).
        assert {"blocks.0.hook_resid_pre", "blocks.0.hook_attn_out", "blocks.0.attn.hook_pattern",
                "blocks.0.mlp.hook_post", "blocks.1.hook_resid_post"} <= common
        assert all("_norm." in h or "_post." in h or h.endswith("mlp.hook_pre_linear") for h in hooks - common), (
            family, sorted(hooks - common))

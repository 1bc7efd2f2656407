"""Checkpoints written by glasslm 0.1.0 (tests/fixtures/v0_1_0, made before the package redesign)
keep loading, with the logits that release computed, and a run saved by it resumes."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glasslm.hf import load_model
from glasslm.io.checkpoint import load_checkpoint, save_checkpoint
from glasslm.cli import main
from glasslm.transforms import applied_transforms

FIXTURES = Path(__file__).parents[1] / "fixtures" / "v0_1_0"
EXPECTED = load_file(FIXTURES / "expected_logits.safetensors")


@pytest.mark.parametrize("name", ["char-run-step3", "char-int8", "char-int4"])
def test_a_0_1_0_checkpoint_gives_the_logits_it_gave(name):
    model, _ = load_model(FIXTURES / name)
    stored = load_file(FIXTURES / name / "model.safetensors")
    assert all(torch.equal(model.state_dict()[key], tensor) for key, tensor in stored.items())  # read exactly
    with torch.no_grad():
        logits = model(EXPECTED["ids"]).float()
        for module in model.modules():  # the quantized layers' readable path: the exact dequantized product
            if hasattr(module, "dequantized_weight"):
                module.impl = "readable"
        exact = model(EXPECTED["ids"]).float()
    expected = EXPECTED[name.replace("-", "_")]
    if not applied_transforms(model):  # float weights: only the CPU kind's own float rounding may differ
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        return
    # 0.1.0 computed its quantized logits with PyTorch's kernels, which rounded activations to int8 in one
    # pass (fbgemm) or ran the product in bf16 (the int4 kernel); glasslm's own kernels (glasslm.kernels)
    # compute the exact dequantized product closely. So: the weights are read exactly (above), the kernels
    # equal the exact product of them, and that product is 0.1.0's logits up to 0.1.0's own kernel
    # rounding (measured: 4.0e-3 for int8, 1.5e-3 for int4, on logits up to 0.8).
    torch.testing.assert_close(logits, exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(exact, expected, rtol=0, atol=5e-3)


def test_a_0_1_0_training_checkpoint_resumes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(FIXTURES / "char-run-step3", run / "ckpt-000003")
    (run / "latest").write_text("ckpt-000003\n")
    text = tmp_path / "text.txt"
    # The fixture's characters came from Shakespeare's first 3,000 characters; use only those.
    text.write_text("First Citizen: Before we proceed any further, hear me speak.\n" * 40)
    assert main(["train", "--resume", str(run), "--data", str(text), "--max-steps", "5", "--threads", "1"]) == 0
    assert (run / "ckpt-000005" / "model.safetensors").is_file()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_0_1_0_quantization_reads_as_a_transform_and_saves_in_the_new_form(method, tmp_path):
    # 0.1.0 wrote meta.json {"quantization": "int8"}; it loads as the transform int8 was applied,
    # and saving the model again records it under "transforms", which loads with the same logits.
    model, tokenizer, meta = load_checkpoint(FIXTURES / f"char-{method}")
    assert meta["quantization"] == method and "transforms" not in meta
    assert applied_transforms(model) == [{"name": method}]
    again, _, meta = load_checkpoint(save_checkpoint(tmp_path / "again", model, tokenizer))
    assert meta == {"transforms": [{"name": method}]}
    with torch.no_grad():
        assert torch.equal(again(EXPECTED["ids"]), model(EXPECTED["ids"]))


def test_a_0_1_0_char_tokenizer_has_no_end_of_text_and_keeps_its_ids(tmp_path):
    """Char tokenizers gained <|endoftext|> later: an old one keeps exactly its characters and ids."""
    import json

    from glasslm.hf import export_hf
    from glasslm.tokenizers import CharTokenizer

    chars = json.loads((FIXTURES / "char-run-step3" / "tokenizer.json").read_text())["chars"]
    model, tokenizer, _ = load_checkpoint(FIXTURES / "char-run-step3")
    assert isinstance(tokenizer, CharTokenizer) and tokenizer.special_tokens == {}
    assert tokenizer.vocab_size == len(chars) == model.config.vocab_size
    assert tokenizer.encode("".join(chars)) == list(range(len(chars)))
    assert model.eos_token_ids == ()
    out = export_hf(model, tmp_path / "hf", tokenizer)
    assert json.loads((out / "generation_config.json").read_text()).get("eos_token_id") is None
    assert "eos_token" not in json.loads((out / "tokenizer_config.json").read_text())

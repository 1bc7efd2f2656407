"""Fine-tuning: the loss only on assistant tokens, `glasslm finetune` (LoRA, QLoRA, full), adapter
checkpoints (small, loaded as base + adapters, a changed base refused), exact resume, merge to a
full model that transformers loads, and the adapters exported to peft."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from glasslm.cli import main
from glasslm.cli.finetune import FINETUNE_DEFAULTS
from glasslm.core.model import TransformerLM
from glasslm.data.sft import encode_conversation
from glasslm.hf import load_model
from glasslm.io.checkpoint import (
    WEIGHTS_FILE,
    read_safetensors,
    resolve_checkpoint,
    save_checkpoint,
)
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer
from glasslm.training.batches import SFTBatches
from glasslm.training.config import TrainConfig
from glasslm.training.evaluator import evaluate
from glasslm.training.step import forward_backward

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
TOKENIZER = CharTokenizer.from_text("abcdefgh ua:;")
CONVERSATIONS = [[{"role": "user", "content": u}, {"role": "assistant", "content": a}]
                 for u, a in [("abc", "cba"), ("hg fe", "ef gh"), ("d", "d"), ("ab cd", "dc ba"), ("efgh", "hgfe"),
                              ("ba", "ab"), ("cc dd", "dd cc"), ("a b", "b a")]]


def _model(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_preset("llama-tiny", vocab_size=TOKENIZER.vocab_size, context_length=32, n_layers=2,
                                    **overrides))


def _assistant_only_loss(model, conversations) -> torch.Tensor:
    """The mean of -log p(next char) over the characters of the assistant turns ("a:...;"), found
    in the rendered text by hand: the independent reference for the training loss."""
    total, count = 0.0, 0
    for messages in conversations:
        user, answer = messages[0]["content"], messages[1]["content"]
        text = f"u:{user};a:{answer};"
        ids = torch.tensor([TOKENIZER.encode(text)])
        log_probs = torch.log_softmax(model(ids)[0].double(), dim=-1)              # (seq, vocab)
        first = len(f"u:{user};")  # the assistant's first character
        for t in range(first, len(text)):  # predicted from position t - 1
            total -= log_probs[t - 1, ids[0, t]]
            count += 1
    return total / count


def test_the_loss_is_the_mean_over_assistant_tokens_only():
    model = _model()
    examples = [encode_conversation(TOKENIZER, TEMPLATE, m) for m in CONVERSATIONS[:4]]
    x, y = SFTBatches(examples, 32).eval_batches(4, 1, torch.Generator()).__next__()[:2]
    loss = forward_backward(model, x, y, accum_steps=1)
    expected = _assistant_only_loss(model, CONVERSATIONS[:4])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    with torch.no_grad():  # with the prompt's tokens counted it would differ: the check can fail
        everything = F.cross_entropy(model(x)[:, :-1].reshape(-1, model.config.vocab_size), x[:, 1:].reshape(-1),
                                     ignore_index=-1)
    assert everything.item() != pytest.approx(expected.item(), rel=1e-5)


def test_validation_is_the_token_mean_over_every_held_out_conversation():
    model = _model().eval()
    examples = [encode_conversation(TOKENIZER, TEMPLATE, m) for m in CONVERSATIONS]
    loss = evaluate(model, SFTBatches(examples, 32), TrainConfig(batch_size=3, device="cpu"))
    assert loss == pytest.approx(_assistant_only_loss(model, CONVERSATIONS).item(), rel=1e-5)


@pytest.fixture
def base(tmp_path):
    save_checkpoint(tmp_path / "base", _model(), TOKENIZER)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 4))
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    return tmp_path


def _finetune(folder, out, *extra):
    args = ["finetune", "--checkpoint", str(folder / "base"), "--data", str(folder / "chat.jsonl"),
            "--chat-template", str(folder / "template.jinja"), "--out", str(folder / out), "--batch-size", "4",
            "--eval-interval", "2", "--lr", "1e-2", "--warmup-steps", "0", "--no-progress", "--device", "cpu", *extra]
    assert main(args) == 0


def _logits(model):
    ids = torch.tensor([TOKENIZER.encode("u:abc;a:cba;")])
    with torch.no_grad():
        return model.eval()(ids)


def test_a_lora_run_saves_only_the_adapters_and_loads_as_base_plus_adapters(base):
    _finetune(base, "ft", "--max-steps", "4", "--lora-sites", "q,v,mlp_down")
    saved = read_safetensors(resolve_checkpoint(base / "ft", prefer=("latest",)) / WEIGHTS_FILE)
    assert saved and all(".lora_a." in name or ".lora_b." in name for name in saved)
    assert sum(t.numel() for t in saved.values()) < _model().num_parameters() / 10
    adapted, tokenizer = load_model(base / "ft")
    plain, _ = load_model(base / "base")
    assert tokenizer is not None and (_logits(adapted) - _logits(plain)).abs().max() > 1e-3  # the adapters trained
    assert main(["generate", "--checkpoint", str(base / "ft"), "--prompt", "u:abc;", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0  # generate (like serve and eval) loads base + adapters
    with pytest.raises(ValueError, match="adapters"):  # glasslm.io alone cannot load it, and says why
        from glasslm.io.checkpoint import load_checkpoint
        load_checkpoint(base / "ft")


def test_a_changed_base_is_refused(base):
    _finetune(base, "ft", "--max-steps", "2")
    changed = _model()
    with torch.no_grad():
        changed.embed.weight[0, 0] += 1.0
    save_checkpoint(base / "base", changed, TOKENIZER)
    with pytest.raises(ValueError, match="has changed"):
        load_model(base / "ft")


@pytest.mark.parametrize("extra", [(), ("--quantize", "int4"), ("--full",)], ids=["lora", "qlora", "full"])
def test_a_resumed_finetune_ends_where_the_uninterrupted_one_does(base, extra):
    # One thread, given: the default count follows the machine's load, which may change between runs.
    _finetune(base, "whole", "--max-steps", "4", "--lr-decay-steps", "4", "--threads", "1", *extra)
    _finetune(base, "halves", "--max-steps", "2", "--lr-decay-steps", "4", "--threads", "1", *extra)
    assert main(["finetune", "--resume", str(base / "halves"), "--max-steps", "4", "--no-progress"]) == 0
    whole = read_safetensors(resolve_checkpoint(base / "whole", prefer=("latest",)) / WEIGHTS_FILE)
    halves = read_safetensors(resolve_checkpoint(base / "halves", prefer=("latest",)) / WEIGHTS_FILE)
    assert whole.keys() == halves.keys() and all(torch.equal(whole[k], halves[k]) for k in whole)


@pytest.mark.parametrize("extra", [(), ("--quantize", "int4")], ids=["lora", "qlora"])
def test_merge_writes_a_model_transformers_loads_with_the_adapted_logits(base, extra, capsys):
    transformers = pytest.importorskip("transformers")
    _finetune(base, "ft", "--max-steps", "3", *extra)
    adapted, _ = load_model(base / "ft")
    for layer in adapted.modules():  # the int4 kernel rounds activations to bf16; the readable path is exact
        if hasattr(layer, "dequantized_weight"):
            layer.impl = "readable"
    assert main(["merge", "--checkpoint", str(base / "ft"), "--out", str(base / "merged"), "--to-hf"]) == 0
    assert ("dequantized" in capsys.readouterr().out) == bool(extra)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([TOKENIZER.encode("u:abc;a:cba;")])
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (theirs - _logits(adapted)).abs().max() <= 1e-4 * max(1.0, theirs.abs().max().item())


@pytest.mark.parametrize("variant", [
    (), ("--lora-dora", "--lora-rslora", "--lora-bias", "all", "--lora-full", "embed,unembed")],
    ids=["lora", "dora-rslora-bias-full"])
def test_a_lora_adapter_trained_on_an_hf_base_exports_to_peft_with_equal_logits(base, variant):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    assert main(["convert", "--to-hf", "--checkpoint", str(base / "base"), "--out", str(base / "hf-base")]) == 0
    args = ["finetune", "--checkpoint", str(base / "hf-base"), "--data", str(base / "chat.jsonl"), "--chat-template",
            str(base / "template.jinja"), "--out", str(base / "ft"), "--batch-size", "4", "--max-steps", "3",
            "--lr", "1e-2", "--no-progress", "--device", "cpu", "--lora-sites", "q,k,v,attn_out,mlp_up",
            "--export-peft", str(base / "peft-a"), *variant]
    assert main(args) == 0
    assert main(["convert", "--to-peft", "--checkpoint", str(base / "ft"), "--out", str(base / "peft-b")]) == 0
    adapted, _ = load_model(base / "ft")
    ids = torch.tensor([TOKENIZER.encode("u:abc;a:cba;")])
    for exported in ("peft-a", "peft-b"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(base / "hf-base", dtype=torch.float32)
        with torch.no_grad():
            theirs = peft.PeftModel.from_pretrained(hf, base / exported).eval()(ids).logits
        assert (theirs - _logits(adapted)).abs().max() <= 2e-5 * max(1.0, theirs.abs().max().item())
    assert (_logits(adapted) - _logits(load_model(base / "hf-base")[0])).abs().max() > 1e-3  # the adapters trained


def test_a_peft_export_names_a_base_that_auto_peft_loads(base):
    """AutoPeftModelForCausalLM loads `base_model_name_or_path` with transformers: a glasslm base is
    exported beside the adapter (DIR/base), an HF base is named by its own directory."""
    peft = pytest.importorskip("peft")
    _finetune(base, "ft", "--max-steps", "3", "--lora-sites", "q,v,mlp_down")
    assert main(["convert", "--to-peft", "--checkpoint", str(base / "ft"), "--out", str(base / "peft")]) == 0
    config = json.loads((base / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((base / "peft" / "base").resolve())
    with torch.no_grad():
        theirs = peft.AutoPeftModelForCausalLM.from_pretrained(base / "peft", dtype=torch.float32).eval()(
            torch.tensor([TOKENIZER.encode("u:abc;a:cba;")])).logits
    ours = _logits(load_model(base / "ft")[0])
    assert (theirs - ours).abs().max() <= 2e-5 * max(1.0, theirs.abs().max().item())
    assert main(["convert", "--to-hf", "--checkpoint", str(base / "base"), "--out", str(base / "hf-base")]) == 0
    args = ["finetune", "--checkpoint", str(base / "hf-base"), "--data", str(base / "chat.jsonl"), "--chat-template",
            str(base / "template.jinja"), "--out", str(base / "ft-hf"), "--batch-size", "4", "--max-steps", "2",
            "--no-progress", "--device", "cpu", "--export-peft", str(base / "peft-hf")]
    assert main(args) == 0
    config = json.loads((base / "peft-hf" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((base / "hf-base").resolve())
    assert not (base / "peft-hf" / "base").exists()
    peft.AutoPeftModelForCausalLM.from_pretrained(base / "peft-hf")


def test_finetune_help_shows_the_training_settings_a_run_uses(base, capsys):
    import re

    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert main(["finetune", "--checkpoint", str(base / "base"), "--data", str(base / "chat.jsonl"), "--chat-template",
                 str(base / "template.jinja"), "--out", str(base / "ft"), "--max-steps", "1", "--no-progress",
                 "--device", "cpu"]) == 0
    used = json.loads((resolve_checkpoint(base / "ft") / "trainer_state.json").read_text())["train_config"]
    checked = 0
    for name in ("batch_size", "weight_decay", "optimizer", "seed"):
        shown = re.search(rf"--{name.replace('_', '-')} [A-Z{{]\S* .*?\(default: ([^)]+)\)", text).group(1)
        assert shown == str(used[name]), name
        checked += 1
    assert checked == 4
    # the settings that follow the data and the base: help states each rule
    for option, rule in (("--max-steps INT", f"{FINETUNE_DEFAULTS['max_steps']} for sft with conversations held out"),
                         ("--lr FLOAT", "3e-3 x sqrt(10M / the base's parameters)"),
                         ("--eval-interval INT", "one pass over the training data"),
                         ("--early-stop INT", "3 for sft with conversations held out"),
                         ("--epochs N", "3 passes")):
        assert rule in text.split(option, 1)[1][:300], option


def test_the_default_length_and_learning_rate_follow_the_data_and_the_base(base, capsys):
    """Issue 47: with no length or rate given, a supervised run stops when its held-out loss stops improving
    (it ran 1,000 steps at lr 3e-3 before, whatever the data and the base); the learning rate follows the
    base's size; a DPO run is 3 passes at a third of the rate; --epochs sets the passes."""
    from glasslm.training.finetune import lora_learning_rate

    data = base / "chat.jsonl"
    assert main(["finetune", "--checkpoint", str(base / "base"), "--data", str(data), "--chat-template",
                 str(base / "template.jinja"), "--out", str(base / "ft"), "--no-progress", "--device", "cpu",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    used = json.loads((resolve_checkpoint(base / "ft", prefer=("latest",)) / "trainer_state.json").read_text())
    cfg, step = used["train_config"], used["step"]
    n_base = _model().num_parameters()
    assert cfg["lr"] == pytest.approx(lora_learning_rate(n_base)) and cfg["early_stop"] == 3
    assert cfg["eval_interval"] == 5  # 29 training conversations: 4 steps of 8 a pass, at least 5
    assert step < cfg["max_steps"] == 1000 and "stopped early" in out and "done: val loss" in out
    records = [json.loads(line) for line in (base / "ft" / "metrics.jsonl").read_text().splitlines()]
    held_out = [r["val_loss"] for r in records if "val_loss" in r]
    best = min(held_out)
    assert all(loss > best - 1e-3 for loss in held_out[-3:])  # the last three evaluations did not improve
    pairs = base / "prefs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": m[0]["content"], "chosen": m[1]["content"], "rejected": "h"}) + "\n"
                             for m in CONVERSATIONS * 3))  # 24 pairs: 22 to train on, 3 steps of 8 a pass
    for extra, steps in (((), 9), (("--epochs", "2"), 6)):
        assert main(["finetune", "--checkpoint", str(base / "base"), "--method", "dpo", "--data", str(pairs),
                     "--chat-template", str(base / "template.jinja"), "--out", str(base / "dpo"), "--overwrite",
                     "--no-progress", "--device", "cpu", "--threads", "1", *extra]) == 0
        dpo = json.loads((resolve_checkpoint(base / "dpo", prefer=("latest",)) / "trainer_state.json").read_text())
        assert dpo["step"] == dpo["train_config"]["max_steps"] == steps
        assert dpo["train_config"]["lr"] == pytest.approx(lora_learning_rate(n_base) / 3)
    assert main(["finetune", "--checkpoint", str(base / "base"), "--data", str(data), "--epochs", "2",
                 "--max-steps", "4", "--out", str(base / "both")]) == 1
    assert "--epochs" in capsys.readouterr().err


def test_converting_an_adapter_checkpoint_to_hf_says_to_merge_it(base, capsys):
    _finetune(base, "ft", "--max-steps", "1")
    capsys.readouterr()  # the fine-tune's own lines (a busy machine's threads line among them)
    assert main(["convert", "--to-hf", "--checkpoint", str(base / "ft"), "--out", str(base / "hf")]) == 1
    err = capsys.readouterr().err
    assert "glasslm merge" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_finetune_options_are_named(base, capsys):
    assert main(["finetune", "--checkpoint", str(base / "base"), "--data", str(base / "chat.jsonl"), "--full",
                 "--quantize", "int4", "--out", str(base / "x")]) == 1
    assert "--quantize" in capsys.readouterr().err
    assert main(["finetune", "--checkpoint", str(base / "base"), "--data", str(base / "chat.jsonl"),
                 "--lora-sites", "q,nope", "--out", str(base / "x")]) == 1
    assert "nope" in capsys.readouterr().err
    assert main(["finetune", "--checkpoint", str(base / "base"), "--data", str(base / "chat.jsonl"),
                 "--out", str(base / "x")]) == 1  # the base has no chat template and none was given
    assert "--chat-template" in capsys.readouterr().err


def test_help_names_each_default_that_differs_from_trls_with_the_reason(capsys):
    """Issue 47: AdamW's beta2, the warm-up, the decay to min_lr and GRPO's KL weight differ from TRL's
    defaults; help and docs/training.md say so, with TRL's value and why."""
    from pathlib import Path

    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, trl in (("--beta2 FLOAT", "TRL: 0.999"), ("--warmup-steps INT", "TRL: none"),
                        ("--min-lr FLOAT", "TRL: linear decay to 0"), ("--grpo-beta FLOAT", "TRL 1.16: 0")):
        entry = text.split(option, 1)[1][:400]
        assert trl in entry and ("." in entry.split(trl, 1)[1][:200]), option  # TRL's value, then why
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text().split())
    section = docs.split("## Where the defaults differ from TRL's", 1)[1][:3000]
    for name in ("beta2", "warmup", "min_lr", "grpo_beta"):
        assert name in section, name

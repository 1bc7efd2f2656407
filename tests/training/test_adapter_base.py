"""A LoRA run and the base it was trained on (issue 32): the adapters record the exact base
checkpoint and its hash, training the base's run further never prunes that checkpoint, `--base`
points the adapters at a moved or copied base, and adapter checkpoints that recorded a run directory
(before issue 32) keep loading after that run moved on."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from glasslm.cli import main
from glasslm.hf import load_model
from glasslm.io.checkpoint import ADAPTER_BASE_KEY, META_FILE, read_json, read_pointer, resolve_checkpoint

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
TINY = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--d-mlp", "64", "--context-length", "32",
        "--batch-size", "4", "--eval-interval", "2", "--eval-iters", "2", "--no-progress", "--device", "cpu"]


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """The README's sequence up to the fine-tune: train a base, fine-tune LoRA on its run directory."""
    monkeypatch.chdir(tmp_path)
    text = "".join(f"u:{w} a:{w[::-1]}\n" for w in ("abc", "bca", "cab", "acb") * 200)
    (tmp_path / "text.txt").write_text(text)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]}) + "\n"
        for w in ("abc", "bca", "cab", "acb") * 3))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert main(["train", "--data", "text.txt", "--out", "runs/base", "--max-steps", "6", *TINY]) == 0
    assert main(["finetune", "--checkpoint", "runs/base", "--data", "chat.jsonl", "--chat-template", "t.jinja",
                 "--out", "runs/ft", "--max-steps", "2", "--batch-size", "4", "--no-progress", "--device", "cpu"]) == 0
    return tmp_path


def _recorded_base(run: str) -> str:
    return read_json(resolve_checkpoint(run) / META_FILE)[ADAPTER_BASE_KEY]["path"]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor([[0, 1, 2, 3]]))


def test_training_the_base_further_leaves_the_adapters_usable(runs, capsys):
    base_checkpoint = _recorded_base("runs/ft")
    assert base_checkpoint == str((runs / "runs/base" / read_pointer("runs/base", "best").name).resolve())
    before = _logits(load_model("runs/ft")[0])
    # README: `glasslm train --resume runs/char --max-steps 800` after the fine-tune (default --keep-last 2).
    assert main(["train", "--resume", "runs/base", "--max-steps", "12", "--no-progress"]) == 0
    assert read_pointer("runs/base", "best").resolve() != runs / base_checkpoint  # `best` moved on
    assert (runs / base_checkpoint).is_dir()  # kept: a LoRA run uses it
    assert len(list((runs / "runs/base").glob("ckpt-*"))) == 3
    assert torch.equal(_logits(load_model("runs/ft")[0]), before)
    assert main(["generate", "--checkpoint", "runs/ft", "--prompt", "u:abc", "--max-new-tokens", "3"]) == 0
    shutil.rmtree(runs / "runs/ft")  # no run uses it any more: the next save prunes it
    assert main(["train", "--resume", "runs/base", "--max-steps", "14", "--no-progress"]) == 0
    assert not (runs / base_checkpoint).exists()


def test_base_points_the_adapters_at_a_moved_base(runs, capsys):
    base_checkpoint = _recorded_base("runs/ft")
    before = _logits(load_model("runs/ft")[0])
    shutil.copytree(base_checkpoint, runs / "elsewhere")
    shutil.rmtree(runs / "runs/base")
    assert main(["generate", "--checkpoint", "runs/ft", "--prompt", "u:abc", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "--base PATH" in err  # the advice ...
    assert main(["generate", "--checkpoint", "runs/ft", "--base", "elsewhere", "--prompt", "u:abc",
                 "--max-new-tokens", "2"]) == 0  # ... works
    assert torch.equal(_logits(load_model("runs/ft", base="elsewhere")[0]), before)
    assert main(["merge", "--checkpoint", "runs/ft", "--base", "elsewhere", "--out", "merged"]) == 0
    assert main(["finetune", "--resume", "runs/ft", "--base", "elsewhere", "--max-steps", "3", "--no-progress"]) == 0
    assert _recorded_base("runs/ft") == str((runs / "elsewhere").resolve())  # the run now names where it is


def test_a_base_with_other_weights_is_refused_with_what_to_do(runs, capsys):
    assert main(["train", "--resume", "runs/base", "--max-steps", "8", "--no-progress"]) == 0
    other = resolve_checkpoint("runs/base", prefer=("latest",))
    assert main(["generate", "--checkpoint", "runs/ft", "--base", str(other), "--prompt", "u:a",
                 "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "hash differently" in err and "--base PATH" in err


def test_an_adapter_that_recorded_a_run_directory_keeps_loading(runs):
    """Before issue 32 the adapters named the base's run directory, which follows `best`."""
    for checkpoint in (runs / "runs/ft").glob("ckpt-*"):
        meta = read_json(checkpoint / META_FILE)
        meta[ADAPTER_BASE_KEY]["path"] = meta["finetune"]["base"] = str((runs / "runs/base").resolve())
        (checkpoint / META_FILE).write_text(json.dumps(meta))
    before = _logits(load_model("runs/ft")[0])
    assert main(["train", "--resume", "runs/base", "--max-steps", "10", "--keep-last", "0", "--no-progress"]) == 0
    assert torch.equal(_logits(load_model("runs/ft")[0]), before)  # the checkpoint that hashes right is found
    assert main(["finetune", "--resume", "runs/ft", "--max-steps", "3", "--no-progress"]) == 0


def test_base_is_only_for_adapter_checkpoints(runs, capsys):
    assert main(["generate", "--checkpoint", "runs/base", "--base", "runs/base", "--prompt", "a"]) == 1
    assert "not adapters" in capsys.readouterr().err

"""`glasslm train --resume` keeps every setting of the run it continues that the command does not
change, says in one line which it changes, and says so when there is nothing left to train (issue 43)."""

import json

from glasslm.cli import main
from glasslm.training.loggers import read_metrics

TINY = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--context-length", "16", "--batch-size", "2",
        "--eval-iters", "1", "--no-progress", "--threads", "1"]
SAMPLE = "--- sample ---"


def _first_run(tmp_path, shakespeare_text, capsys, *extra):
    text = tmp_path / "t.txt"
    text.write_text(shakespeare_text[:5000])
    run = tmp_path / "run"
    assert main(["train", "--data", str(text), "--out", str(run), "--max-steps", "3", *TINY, *extra]) == 0
    capsys.readouterr()
    return run


def test_resume_keeps_sample_tokens_0_and_names_what_it_changes(tmp_path, shakespeare_text, capsys):
    run = _first_run(tmp_path, shakespeare_text, capsys, "--sample-tokens", "0")
    assert json.loads((run / "ckpt-000003" / "meta.json").read_text())["sample_tokens"] == 0
    assert main(["train", "--resume", str(run), "--max-steps", "4"]) == 0
    out = capsys.readouterr().out
    assert SAMPLE not in out, "the run had switched its sample off"
    changed = [line for line in out.splitlines() if line.startswith("settings changed from the run's")]
    assert changed == ["settings changed from the run's: max_steps 3 -> 4"], out
    assert main(["train", "--resume", str(run), "--max-steps", "5", "--sample-tokens", "7", "--lr", "0.002"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("settings changed from the run's"))
    assert "max_steps 4 -> 5" in line and "sample_tokens 0 -> 7" in line and "-> 0.002" in line, line
    assert "batch_size" not in line and "data" not in line, "unchanged settings are not listed"
    assert SAMPLE in out


def test_a_resume_with_nothing_to_train_says_so_in_one_line(tmp_path, shakespeare_text, capsys):
    run = _first_run(tmp_path, shakespeare_text, capsys, "--sample-tokens", "0")
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    for max_steps in ("2", "3"):
        assert main(["train", "--resume", str(run), "--max-steps", max_steps]) == 0
        captured = capsys.readouterr()
        assert captured.err == "" and captured.out.count("\n") == 1, captured
        assert captured.out.startswith(f"nothing to train: {run / 'ckpt-000003'} is at step 3 and --max-steps is "
                                       f"{max_steps}"), captured.out
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before, "nothing written"
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == 3

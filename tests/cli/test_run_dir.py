"""A run stopped before its first checkpoint (issue 20, 7a): its directory holds nothing to resume,
so the command that started it starts it afresh, and every refusal's advice works when followed."""

import json

from glasslm.cli import main
from glasslm.training.loggers import read_metrics

TINY = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--context-length", "16", "--batch-size", "2",
        "--eval-iters", "1", "--no-progress", "--sample-tokens", "0"]
OLD_METRICS = json.dumps({"step": 10, "train_loss": 3.5}) + "\n"


def _killed_before_first_checkpoint(run):
    """What SIGKILL at step 10, while the first checkpoint was being written, leaves behind."""
    run.mkdir()
    (run / "metrics.jsonl").write_text(OLD_METRICS)
    (run / ".lock").write_text("4242\n")
    (run / ".ckpt-000020").mkdir()
    (run / ".ckpt-000020" / "model.safetensors").write_bytes(b"half written")


def test_resume_says_there_is_nothing_to_resume_and_the_plain_command_starts_afresh(tmp_path, shakespeare_text,
                                                                                    capsys):
    text = tmp_path / "t.txt"
    text.write_text(shakespeare_text[:5000])
    run = tmp_path / "run"
    _killed_before_first_checkpoint(run)
    assert main(["train", "--resume", str(run), "--max-steps", "2"]) == 1
    err = capsys.readouterr().err
    assert "holds no checkpoint" in err and "without --resume" in err and err.count("\n") == 1, err
    assert main(["train", "--data", str(text), "--out", str(run), "--max-steps", "2", *TINY]) == 0  # the advice
    assert "holds no checkpoint" in capsys.readouterr().out
    assert (run / "metrics.jsonl.unfinished").read_text() == OLD_METRICS  # kept aside, not mixed in
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "train_loss" in r] == [2]
    assert (run / "ckpt-000002").is_dir() and not (run / ".ckpt-000020").exists()
    # Now it holds a checkpoint: the plain command refuses and --resume, as advised, continues it.
    assert main(["train", "--data", str(text), "--out", str(run), "--max-steps", "2", *TINY]) == 1
    assert f"--resume {run}" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--max-steps", "3", "--sample-tokens", "0"]) == 0
    assert (run / "ckpt-000003").is_dir()


def test_a_second_stopped_start_keeps_both_metrics_files(tmp_path, shakespeare_text, capsys):
    text = tmp_path / "t.txt"
    text.write_text(shakespeare_text[:5000])
    run = tmp_path / "run"
    _killed_before_first_checkpoint(run)
    (run / "metrics.jsonl.unfinished").write_text("earlier\n")
    assert main(["train", "--data", str(text), "--out", str(run), "--max-steps", "1", *TINY]) == 0
    assert (run / "metrics.jsonl.unfinished").read_text() == "earlier\n"
    assert (run / "metrics.jsonl.unfinished-2").read_text() == OLD_METRICS


def test_a_directory_without_a_checkpoint_is_never_told_to_resume(tmp_path, shakespeare_text, capsys):
    text = tmp_path / "t.txt"
    text.write_text(shakespeare_text[:5000])
    run = tmp_path / "run"
    _killed_before_first_checkpoint(run)
    (run / "notes.txt").write_text("mine")  # not glasslm's: the directory is not a stopped run alone
    assert main(["train", "--data", str(text), "--out", str(run), "--max-steps", "1", *TINY]) == 1
    err = capsys.readouterr().err
    assert "--resume" not in err and "no checkpoint" in err and "--overwrite" in err
    assert main(["train", "--data", str(text), "--out", str(run), "--max-steps", "1", "--overwrite", *TINY]) == 0
    assert (run / "notes.txt").read_text() == "mine" and (run / "ckpt-000001").is_dir()

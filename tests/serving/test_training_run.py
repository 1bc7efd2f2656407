"""GET /api/run: the served checkpoint's run metrics, as written, for the explorer's "Training run" panel."""

import json

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.io.checkpoint import save_checkpoint, write_pointer  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.tokenizers import CharTokenizer  # noqa: E402
from glasslm.training.loggers import METRICS_FILE, run_metrics_file  # noqa: E402

# What a GRPO run logs (glasslm.training.grpo): per-step reward and its group std, KL, lengths; a validation step.
GRPO_RECORDS = [
    {"step": 1, "tokens": 96, "train_loss": 0.013, "lr": 1e-5, "reward": 0.25, "reward_std": 0.31, "kl": 0.0,
     "completion_length": 11.5, "completion_length_max": 16},
    {"step": 2, "tokens": 192, "train_loss": -0.021, "lr": 1e-5, "reward": 0.375, "reward_std": 0.28, "kl": 0.0041,
     "completion_length": 10.25, "completion_length_max": 14},
    {"step": 2, "val_loss": 1.75, "val_reward": 0.4},
    {"step": 3, "tokens": 288, "train_loss": 0.007, "lr": 1e-5, "reward": 0.5, "reward_std": 0.22, "kl": 0.0093,
     "completion_length": 9.0, "completion_length_max": 12},
]
DPO_RECORD = {"step": 1, "train_loss": 0.69, "rewards/margins": 0.012, "rewards/accuracies": 0.75}


def tiny_app(metrics_file=None):
    tok = CharTokenizer.from_text("ab")
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1)).eval()
    return create_app(model, tok, metrics_file=metrics_file)


def write_records(path, records, torn: str = ""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_the_run_is_the_records_as_written_and_a_torn_last_line_is_skipped(tmp_path):
    metrics = tmp_path / "grpo-run" / METRICS_FILE
    metrics.parent.mkdir()
    write_records(metrics, GRPO_RECORDS, torn='{"step": 4, "tokens": 38')  # a step being written
    client = TestClient(tiny_app(metrics))
    answer = client.get("/api/run").json()
    assert answer["run"] == "grpo-run" and answer["records"] == GRPO_RECORDS
    assert [key for key, _ in answer["signals"]] == ["reward", "kl", "completion_length"]
    # Read on every request: the run's next steps show without restarting the server.
    write_records(metrics, GRPO_RECORDS + [DPO_RECORD | {"step": 4}])
    answer = client.get("/api/run").json()
    assert answer["records"][-1] == DPO_RECORD | {"step": 4} and len(answer["records"]) == len(GRPO_RECORDS) + 1
    assert [key for key, _ in answer["signals"]] == ["reward", "kl", "completion_length", "rewards/margins",
                                                     "rewards/accuracies"]


def test_non_json_numbers_and_lines_that_are_no_record_do_not_break_the_answer(tmp_path):
    metrics = tmp_path / METRICS_FILE
    metrics.write_text('{"step": 1, "train_loss": NaN, "kl": Infinity}\n[1, 2]\n\n{"step": 2, "train_loss": 1.5}\n')
    answer = TestClient(tiny_app(metrics)).get("/api/run")
    assert answer.status_code == 200
    assert answer.json()["records"] == [{"step": 1, "train_loss": None, "kl": None}, {"step": 2, "train_loss": 1.5}]


def test_without_a_run_the_answer_says_why(tmp_path):
    for app in (tiny_app(), tiny_app(tmp_path / "gone" / METRICS_FILE)):  # none, or removed since the server started
        answer = TestClient(app).get("/api/run")
        assert answer.status_code == 200
        body = answer.json()
        assert body["run"] is None and body["records"] == [] and body["signals"] == [] and body["reason"]


def test_a_served_path_finds_its_runs_metrics(tmp_path):
    tok = CharTokenizer.from_text("ab")
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1))
    run = tmp_path / "run"
    checkpoint = save_checkpoint(run / "ckpt-000002", model, tok)
    write_pointer(run, "latest", checkpoint.name)
    lone = save_checkpoint(tmp_path / "exported", model, tok)
    gguf = run / "model.gguf"  # an export beside the run is not the run
    gguf.write_bytes(b"GGUF")
    assert [run_metrics_file(p) for p in (run, checkpoint, run / "latest", lone, gguf)] == [None] * 5
    write_records(run / METRICS_FILE, GRPO_RECORDS)
    assert [run_metrics_file(p) for p in (run, checkpoint, run / "latest")] == [run / METRICS_FILE] * 3
    assert run_metrics_file(lone) is None and run_metrics_file(gguf) is None

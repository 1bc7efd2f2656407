"""`glasslm prepare OWNER/NAME --streaming` reads a Hugging Face dataset through the datasets library's
streaming reader, offline, from the local hub (tests/hub_server.py, found through HF_ENDPOINT): the
shards hold exactly what the same records prepared from a local JSONL file give, and nothing is
written to the datasets cache, where the download that --streaming avoids leaves its Arrow files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glasslm.data import load_prepared
from hub_server import HubRepo, LocalHub

SRC = Path(__file__).resolve().parents[2] / "src"
RECORDS = [{"text": f"record {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3), "id": i}
           for i in range(60)]


def prepare(args: list[str], tmp_path: Path, endpoint: str) -> subprocess.CompletedProcess:
    """`glasslm prepare` in a fresh process (huggingface_hub reads HF_ENDPOINT when imported)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "glasslm", "prepare", *args, "--shard-tokens", "500",
                           "--workers", "1", "--quiet"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "downloaded"])
def test_prepare_reads_a_hub_dataset(tmp_path, streaming):
    lines = "".join(json.dumps(record) + "\n" for record in RECORDS).encode()
    local = tmp_path / "records.jsonl"
    local.write_bytes(lines)
    repo = HubRepo()
    repo.add_commit({"data/train.jsonl": lines, "README.md": b"# records\n"}, "main")
    with LocalHub() as hub:
        hub.repos["datasets/someone/records"] = repo  # as the hub's URLs name a dataset repository
        prepare(["someone/records", *(["--streaming"] if streaming else []), "--out", str(tmp_path / "hub")],
                tmp_path, hub.endpoint)
        prepare([str(local), "--out", str(tmp_path / "local")], tmp_path, hub.endpoint)
        fetched = hub.requests("GET", r"^/datasets/someone/records/resolve/[0-9a-f]+/data/train\.jsonl$")
    assert fetched, "the records came from the hub"
    streamed, reference = load_prepared(tmp_path / "hub"), load_prepared(tmp_path / "local")
    assert streamed.tokenizer.vocab_size == reference.tokenizer.vocab_size
    for split in ("train", "val"):
        ours, theirs = getattr(streamed, split), getattr(reference, split)
        assert len(ours) == len(theirs) > 0 and (ours[:] == theirs[:]).all(), split
    arrow = list((tmp_path / "datasets-cache").rglob("*.arrow"))
    assert (arrow == []) == streaming, arrow

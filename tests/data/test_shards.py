"""Sharded datasets (issue 35): JSONL, parquet, Hugging Face datasets and text files tokenized into
fixed-size shards, checked against each document encoded on its own; the same bytes for any
number of workers and after an interrupted run is resumed; clear refusals of bad input; and the
shards read back as one stream that samples, trains and resumes exactly like one flat file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import glasslm.data.shard_prepare as shard_prepare
from glasslm.data import get_batch, load_prepared, prepare, prepare_shards
from glasslm.data.shard_prepare import ReadOptions, tokenizer_sha256
from glasslm.data.sharded import read_manifest
from glasslm.tokenizers import ENDOFTEXT, CharTokenizer, get_tokenizer

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402


def documents(shakespeare_text: str, n: int = 300) -> list[str]:
    """Shakespeare's paragraphs and synthetic ones (with non-ASCII text and empty documents)."""
    paras = [p for p in shakespeare_text.split("\n\n")][:n]
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "γάμμα", "δέλτα", "naïve", "café", "\n", "  ", "12345", "😀"]
    synthetic = [" ".join(rng.choice(words, size=int(rng.integers(0, 60)))) for _ in range(n // 3)]
    return [d for pair in zip(paras, synthetic + paras) for d in pair] + [""]


def write_corpus(root: Path, docs: list[str]) -> Path:
    """The first half of the documents as JSONL (two files), the second as parquet, in that order."""
    root.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    for k, part in enumerate((docs[:half // 2], docs[half // 2:half])):
        (root / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(part)))
    pq.write_table(pa.table({"id": list(range(len(docs) - half)), "text": docs[half:]}), root / "part-2.parquet")
    return root


def expected_streams(tokenizer, docs: list[str], val_fraction: float) -> dict[str, list[int]]:
    """Each record encoded on its own, every 1/val_fraction-th held out, eos between documents."""
    every = round(1 / val_fraction)
    eos = tokenizer.special_tokens[ENDOFTEXT]
    streams: dict[str, list[int]] = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    for i, doc in enumerate(docs):
        split = "val" if i % every == every - 1 else "train"
        streams[split].extend(([eos] if counts[split] else []) + tokenizer.encode(doc))
        counts[split] += 1
    return streams


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shakespeare_text) -> tuple[Path, list[str]]:
    docs = documents(shakespeare_text)
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs), docs


@pytest.fixture(scope="module")
def gpt2(data_dir):
    return get_tokenizer("gpt2", data_dir=data_dir)


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_shards_hold_each_document_encoded_alone(corpus, gpt2, tmp_path, kind):
    root, docs = corpus
    tok = gpt2 if kind == "gpt2" else CharTokenizer.from_text("".join(docs))
    meta = prepare_shards([str(root / "*.jsonl"), str(root / "part-2.parquet")], tok, tmp_path / "ds",
                          shard_tokens=5000, workers=2, progress=False)
    data = load_prepared(tmp_path / "ds")
    expected = expected_streams(tok, docs, 0.1)
    assert data.train.tolist() == expected["train"] and data.val.tolist() == expected["val"]
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(expected["train"]), len(expected["val"]))
    manifest = read_manifest(tmp_path / "ds")
    assert manifest["tokenizer_sha256"] == tokenizer_sha256(tok) and manifest["complete"]
    train = manifest["splits"]["train"]
    assert [s["tokens"] for s in train[:-1]] == [5000] * (len(train) - 1) and 0 < train[-1]["tokens"] <= 5000
    assert [s["start"] for s in train] == [5000 * k for k in range(len(train))]
    assert data.train.dtype == np.uint16 and tok.decode(data.val[:50].tolist()) in ENDOFTEXT.join(docs)


def test_a_saved_hugging_face_dataset_and_a_text_file(corpus, tmp_path, shakespeare_text):
    datasets = pytest.importorskip("datasets")
    _, docs = corpus
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:40]}),
                          "test": datasets.Dataset.from_dict({"text": docs[40:60]})}).save_to_disk(tmp_path / "hf")
    text = tmp_path / "book.txt"
    text.write_text(shakespeare_text[:20_000])
    tok = CharTokenizer.from_text(shakespeare_text + "".join(docs))
    prepare_shards([str(tmp_path / "hf"), str(text)], tok, tmp_path / "ds", shard_tokens=3000, workers=1,
                   read=ReadOptions(split="test"), progress=False)
    data = load_prepared(tmp_path / "ds")
    records = expected_streams(tok, docs[40:60], 0.1)
    flat = tmp_path / "flat"  # the text file as the single-file layout cuts it
    prepare([text], tok, flat, progress=False)
    eos = [tok.special_tokens[ENDOFTEXT]]
    assert data.train.tolist() == records["train"] + eos + load_prepared(flat).train.tolist()
    assert data.val.tolist() == records["val"] + eos + load_prepared(flat).val.tolist()


def test_the_same_bytes_for_any_number_of_workers(corpus, gpt2, tmp_path):
    root, docs = corpus
    tok = CharTokenizer.from_text("".join(docs))
    for name, tokenizer, workers in (("c1", tok, 1), ("c2", tok, 2), ("g1", gpt2, 1), ("g2", gpt2, 2)):
        prepare_shards([str(root)], tokenizer, tmp_path / name, shard_tokens=4000, workers=workers, progress=False)
    assert shard_bytes(tmp_path / "c1") == shard_bytes(tmp_path / "c2")
    assert shard_bytes(tmp_path / "g1") == shard_bytes(tmp_path / "g2")


@pytest.mark.parametrize("workers", [1, 2])
def test_an_interrupted_prepare_resumes_without_redoing_a_shard(corpus, tmp_path, monkeypatch, workers):
    root, docs = corpus
    tok = CharTokenizer.from_text("".join(docs))
    args = ([str(root)], tok)
    options = dict(shard_tokens=3000, workers=workers, progress=False)
    prepare_shards(*args, tmp_path / "whole", **options)
    real_write, written = shard_prepare.write_manifest, []

    def crash_after_3_shards(directory, manifest):
        real_write(directory, manifest)
        written.append(sum(map(len, manifest["splits"].values())))
        if written[-1] == 3:
            raise KeyboardInterrupt  # a Ctrl-C after the third finished shard

    monkeypatch.setattr(shard_prepare, "write_manifest", crash_after_3_shards)
    with pytest.raises(KeyboardInterrupt):
        prepare_shards(*args, tmp_path / "part", **options)
    finished = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (tmp_path / "part" / "shards").glob("*.bin")}
    assert len(finished) == 3 and not (tmp_path / "part" / "meta.json").exists()
    with pytest.raises(ValueError, match="incomplete preparation.*rerun the same prepare command to resume"):
        load_prepared(tmp_path / "part")
    monkeypatch.setattr(shard_prepare, "write_manifest", real_write)
    made = []
    real_flush = shard_prepare.SplitWriter.flush
    monkeypatch.setattr(shard_prepare.SplitWriter, "flush", lambda self, cursor: (
        made.append(len(self.shards)) if self.fill else None, real_flush(self, cursor))[-1])
    prepare_shards(*args, tmp_path / "part", **options)  # the same call resumes
    assert shard_bytes(tmp_path / "part") == shard_bytes(tmp_path / "whole")
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in finished} == finished, "finished shards kept"
    assert len(made) == sum(map(len, read_manifest(tmp_path / "whole")["splits"].values())) - 3, "only the rest made"


def test_resuming_with_another_tokenizer_or_shard_size_is_refused(corpus, gpt2, tmp_path, monkeypatch):
    root, docs = corpus
    tok = CharTokenizer.from_text("".join(docs))

    def crash(directory, manifest):
        raise KeyboardInterrupt

    real_write = shard_prepare.write_manifest
    monkeypatch.setattr(shard_prepare, "write_manifest",
                        lambda d, m: real_write(d, m) if not any(m["splits"].values()) else crash(d, m))
    with pytest.raises(KeyboardInterrupt):
        prepare_shards([str(root)], tok, tmp_path / "ds", shard_tokens=3000, workers=1, progress=False)
    monkeypatch.setattr(shard_prepare, "write_manifest", real_write)
    with pytest.raises(ValueError, match="another tokenizer"):
        prepare_shards([str(root)], gpt2, tmp_path / "ds", shard_tokens=3000, workers=1, progress=False)
    with pytest.raises(ValueError, match="another --shard-tokens"):
        prepare_shards([str(root)], tok, tmp_path / "ds", shard_tokens=2000, workers=1, progress=False)
    prepare_shards([str(root)], gpt2, tmp_path / "ds", shard_tokens=3000, workers=1, progress=False, overwrite=True)
    assert load_prepared(tmp_path / "ds").tokenizer.vocab_size == gpt2.vocab_size


def test_bad_inputs_are_named(tmp_path):
    tok = CharTokenizer.from_text("abc")
    (tmp_path / "a.jsonl").write_text('{"body": "abc"}\n' * 20)
    with pytest.raises(ValueError, match=r"no field 'text' \(it has: body\); .*--field"):
        prepare_shards([str(tmp_path / "a.jsonl")], tok, tmp_path / "o1", progress=False)
    (tmp_path / "b.jsonl").write_text("just text, not JSON\n")
    with pytest.raises(ValueError, match="b.jsonl is not JSONL"):
        prepare_shards([str(tmp_path / "b.jsonl")], tok, tmp_path / "o2", progress=False)
    pq.write_table(pa.table({"content": ["abc"] * 20}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' \(it has: content\); .*--column"):
        prepare_shards([str(tmp_path / "c.parquet")], tok, tmp_path / "o3", progress=False)
    (tmp_path / "d.jsonl").write_text('{"text": "abc"}\n' * 5)
    with pytest.raises(ValueError, match="no validation text: 5 documents"):
        prepare_shards([str(tmp_path / "d.jsonl")], tok, tmp_path / "o4", progress=False)
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n' * 20)
    with pytest.raises(ValueError, match="hold no text"):
        prepare_shards([str(tmp_path / "e.jsonl")], CharTokenizer(["a"]), tmp_path / "o5", progress=False)
    with pytest.raises(FileNotFoundError, match="no file matches"):
        prepare_shards([str(tmp_path / "*.nothing")], tok, tmp_path / "o6", progress=False)
    (tmp_path / "f.jsonl").write_text('{"text": 3}\n' * 20)
    with pytest.raises(ValueError, match="holds int64 values, not text|not text"):
        prepare_shards([str(tmp_path / "f.jsonl")], tok, tmp_path / "o7", progress=False)


# --- the loader -----------------------------------------------------------------------------------------

def test_shards_sample_the_same_windows_as_one_flat_file(tmp_path, shakespeare_text):
    text = tmp_path / "s.txt"
    text.write_text(shakespeare_text[:60_000])
    tok = CharTokenizer.from_text(shakespeare_text)
    prepare([text], tok, tmp_path / "flat", progress=False)
    prepare_shards([str(text)], tok, tmp_path / "sharded", shard_tokens=1000, workers=1, progress=False)
    flat, sharded = load_prepared(tmp_path / "flat"), load_prepared(tmp_path / "sharded")
    assert len(sharded.train.shards) == -(-len(flat.train) // 1000) > 50
    assert sharded.train.tolist() == flat.train.tolist()
    for split in ("train", "val"):
        a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        for _ in range(5):  # windows of 64 over shards of 1000: many cross a boundary
            xa, ya = get_batch(getattr(flat, split), 32, 64, generator=a)
            xb, yb = get_batch(getattr(sharded, split), 32, 64, generator=b)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_a_run_on_shards_resumes_with_identical_losses(tmp_path, shakespeare_text):
    from glasslm.presets import get_preset
    from glasslm.training.config import TrainConfig
    from glasslm.training.loggers import read_metrics
    from glasslm.training.loop import train

    text = tmp_path / "s.txt"
    text.write_text(shakespeare_text[:30_000])
    tok = CharTokenizer.from_text(shakespeare_text)
    prepare_shards([str(text)], tok, tmp_path / "ds", shard_tokens=500, workers=1, progress=False)
    data = load_prepared(tmp_path / "ds")
    model = get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1, d_model=32, n_heads=2,
                       context_length=32, dropout=0.1)

    def cfg(steps: int) -> TrainConfig:
        return TrainConfig(max_steps=steps, lr_decay_steps=16, batch_size=4, warmup_steps=2, eval_interval=4,
                           eval_iters=2, log_interval=1, progress=False)

    full = train(model, cfg(16), data.train, data.val, run_dir=tmp_path / "full")
    first = train(model, cfg(7), data.train, data.val, run_dir=tmp_path / "part")
    second = train(model, cfg(16), data.train, data.val, run_dir=tmp_path / "part", resume=tmp_path / "part")
    assert first.train_losses + second.train_losses == full.train_losses
    assert second.val_losses == [v for v in full.val_losses if v[0] > 7]
    assert [r["train_loss"] for r in read_metrics(tmp_path / "full/metrics.jsonl")] == \
        [r["train_loss"] for r in read_metrics(tmp_path / "part/metrics.jsonl")]
    assert full.train_losses[-1] < full.train_losses[0], "the shards hold the text the model learns"


def test_each_rank_reads_its_own_rows_of_the_global_batch(tmp_path, shakespeare_text):
    """Ranks draw the same global batch from the same generator and build only their row share; the
    shares of 2 (and 3: uneven) ranks put together are the 1-process batch, and every rank's
    generator ends where the 1-process one does."""
    from glasslm.training.batches import WindowBatches

    text = tmp_path / "s.txt"
    text.write_text(shakespeare_text[:20_000])
    tok = CharTokenizer.from_text(shakespeare_text)
    prepare_shards([str(text)], tok, tmp_path / "ds", shard_tokens=700, workers=1, progress=False)
    source = WindowBatches(load_prepared(tmp_path / "ds").train, 16)
    whole_rng = torch.Generator().manual_seed(3)
    whole, _ = source.draw(8, whole_rng)
    for count in (2, 3):
        shares = []
        for index in range(count):
            rng = torch.Generator().manual_seed(3)
            shares.append(source.draw(8, rng, share=(index, count))[0])
            assert torch.equal(rng.get_state(), whole_rng.get_state())
        assert [len(s) for s in shares] == [len(s) for s in whole.tensor_split(count)]
        assert torch.equal(torch.cat(shares), whole) and not torch.equal(shares[0], shares[1])


def test_prepare_and_train_from_the_command_line(corpus, tmp_path, data_dir, monkeypatch, capsys):
    from glasslm.cli import main

    root, _ = corpus
    monkeypatch.setenv("GLASSLM_DATA_DIR", str(data_dir))
    assert main(["prepare", str(root / "*.jsonl"), str(root / "part-2.parquet"), "--tokenizer", "gpt2",
                 "--out", str(tmp_path / "ds"), "--shard-tokens", "20000", "--workers", "2", "--quiet"]) == 0
    assert "shards" in capsys.readouterr().out
    assert main(["train", "--data", str(tmp_path / "ds"), "--n-layers", "1", "--d-model", "32", "--n-heads", "2",
                 "--context-length", "32", "--batch-size", "4", "--max-steps", "4", "--eval-interval", "2",
                 "--eval-iters", "1", "--out", str(tmp_path / "run"), "--no-progress", "--sample-tokens", "0",
                 "--threads", "1"]) == 0
    assert len(list((tmp_path / "run").glob("ckpt-*"))) >= 1
    assert os.path.getsize(tmp_path / "ds" / "manifest.json") > 0


# --- issue 35's "done when", at a size the slow suite affords ------------------------------------------

@pytest.mark.slow
def test_a_corpus_prepared_in_parallel_trains_on_two_processes_and_resumes_on_one(tmp_path, shakespeare_text):
    """Issue 35's path end to end: ~12 MB of JSONL and parquet (Shakespeare's paragraphs and synthetic
    text) prepared by 2 workers into many shards; `torchrun --nproc-per-node 2 ... train` on it loses a
    process mid-run (rank 1 exits at step 25, as a killed process would); `glasslm train --resume` on
    ONE process with the same global batch continues from the 2-process run's distributed checkpoint
    and logs the losses of an uninterrupted one-process run (to float rounding, as 2 processes equal 1)."""
    import subprocess
    import sys

    from glasslm.training.loggers import read_metrics

    docs = documents(shakespeare_text, n=3000) * 12
    write_corpus(tmp_path / "corpus", docs)
    tok = CharTokenizer.from_text("".join(docs))
    meta = prepare_shards([str(tmp_path / "corpus")], tok, tmp_path / "ds", shard_tokens=1_000_000, workers=2,
                          progress=False)
    assert meta["train_tokens"] > 8_000_000 and meta["shards"]["train"] > 8
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests / "training")]),
           "OMP_NUM_THREADS": "1", "GLASSLM_TEST_FAIL_AT_STEP": "25", "GLASSLM_TEST_FAIL_MARKER": str(tmp_path / "x")}
    args = ["--data", str(tmp_path / "ds"), "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--dropout", "0",
            "--context-length", "64", "--max-steps", "40", "--warmup-steps", "5", "--eval-interval", "20",
            "--eval-iters", "2", "--log-interval", "1", "--checkpoint-interval", "5", "--keep-last", "0",
            "--no-progress", "--sample-tokens", "0", "--threads", "1", "--muon-ns-dtype", "float32"]

    def run(command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)

    one = run([sys.executable, "-m", "glasslm.cli", "train", *args, "--batch-size", "8", "--out", "one"])
    assert one.returncode == 0, one.stdout + one.stderr
    two = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
               str(tests / "training" / "failing_train.py"), *args, "--batch-size", "4", "--out", "two"])
    assert two.returncode != 0 and (tmp_path / "x").exists(), two.stdout + two.stderr  # rank 1 died at step 25
    assert (tmp_path / "two" / "ckpt-000020" / "distributed").is_dir(), "each process wrote its own shard"
    resumed = run([sys.executable, "-m", "glasslm.cli", "train", "--resume", "two", "--batch-size", "8"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    def losses(run_dir: str) -> list[tuple]:
        records = read_metrics(tmp_path / run_dir / "metrics.jsonl")
        return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in records]

    whole, continued = losses("one"), losses("two")
    assert [r[0] for r in continued] == [r[0] for r in whole] and whole[-1][0] == 40
    for got, want in zip(continued, whole):
        assert [v is None for v in got] == [v is None for v in want], (got, want)
        assert [v for v in got if v is not None] == pytest.approx([v for v in want if v is not None], rel=1e-5)

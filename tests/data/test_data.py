import hashlib

import pytest
import torch

from glasslm.data import DATASETS, fetch_dataset, get_batch, resolve_text, train_val_split


def test_batches_are_true_next_token_pairs():
    tokens = torch.arange(1000) * 7 % 1013  # distinct values, so each window is identifiable
    x, y = get_batch(tokens, 16, 32, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 32) and x.dtype == torch.long
    for row_x, row_y in zip(x, y):
        start = int((tokens == row_x[0]).nonzero())
        assert torch.equal(row_x, tokens[start:start + 32])
        assert torch.equal(row_y, tokens[start + 1:start + 33])


def test_batches_are_reproducible_from_a_seed():
    tokens = torch.arange(500)
    a = get_batch(tokens, 4, 8, generator=torch.Generator().manual_seed(3))
    b = get_batch(tokens, 4, 8, generator=torch.Generator().manual_seed(3))
    c = get_batch(tokens, 4, 8, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_every_start_position_is_reachable():
    tokens = torch.arange(12)
    x, _ = get_batch(tokens, 2000, 8, generator=torch.Generator().manual_seed(0))
    assert set(x[:, 0].tolist()) == set(range(12 - 8))


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="too small"):
        get_batch(torch.arange(8), 2, 8)


def test_split_is_ninety_ten_in_order():
    tokens = torch.arange(100)
    train, val = train_val_split(tokens)
    assert torch.equal(train, tokens[:90]) and torch.equal(val, tokens[90:])


def test_read_split_parts_rejoin_to_the_file_and_bad_input_is_named(tmp_path):
    from glasslm.data import read_split

    f = tmp_path / "t.txt"
    text = "".join(f"line {i} é\n" for i in range(40))
    f.write_text(text, encoding="utf-8")
    train, val = read_split(f, "train"), read_split(f, "val")
    assert train + val == read_split(f, "all") == text
    assert val.startswith("line ") and train.endswith("\n")  # cut at a line start
    assert len(text.encode()) * 0.1 >= len(val.encode()) > 0  # the default: at most the last 10% of the bytes
    with pytest.raises(ValueError, match="split must be one of train, val, all, got 'test'"):
        read_split(f, "test")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n" * 20)
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8 text"):
        read_split(tmp_path / "latin1.txt", "train")


def test_known_dataset_is_found_and_verified(data_dir):
    path = fetch_dataset("tinyshakespeare", data_dir)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DATASETS["tinyshakespeare"].sha256


def test_corrupt_dataset_file_is_refused(tmp_path):
    (tmp_path / "tinyshakespeare.txt").write_text("not shakespeare")
    with pytest.raises(ValueError, match="sha256"):
        fetch_dataset("tinyshakespeare", tmp_path)


def test_offline_download_says_where_to_put_the_file(tmp_path, monkeypatch):
    import urllib.request

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(RuntimeError, match=str(tmp_path / "tinyshakespeare.txt")):
        fetch_dataset("tinyshakespeare", tmp_path)
    assert not list(tmp_path.iterdir())  # no partial file left behind


def test_resolve_text_errors_on_unknown_name():
    with pytest.raises(FileNotFoundError, match="neither a known dataset"):
        resolve_text("no-such-dataset-or-file")


# --- prepared token files ------------------------------------------------------------------------

import json
import tracemalloc

import numpy as np

from glasslm.data import load_prepared, load_token_file, load_training_data, prepare
from glasslm.tokenizers import CharTokenizer


def test_prepare_splits_losslessly_at_a_line_start(tmp_path, shakespeare_text):
    src = tmp_path / "s.txt"
    src.write_text(shakespeare_text[:50_000])
    tok = CharTokenizer.from_text(shakespeare_text)
    meta = prepare([src], tok, tmp_path / "ds", val_fraction=0.1, chunk_bytes=4096, progress=False)
    data = load_prepared(tmp_path / "ds")
    assert meta["dtype"] == "uint16" and data.train.dtype == np.uint16
    train_text, val_text = tok.decode(data.train.tolist()), tok.decode(data.val.tolist())
    assert train_text + val_text == shakespeare_text[:50_000]
    assert train_text.endswith("\n") and abs(len(val_text) - 5000) < 200
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train_text), len(val_text))


def test_prepare_puts_the_end_of_text_between_files(tmp_path, shakespeare_text):
    from glasslm.data import split_offset
    from glasslm.tokenizers import ENDOFTEXT, train_tokenizer_from_text

    texts = [shakespeare_text[:3000], shakespeare_text[5000:9000], shakespeare_text[20000:22000]]
    paths = []
    for k, text in enumerate(texts):
        paths.append(tmp_path / f"{k}.txt")
        paths[-1].write_text(text)
    cuts = [split_offset(p, 0.1) for p in paths]  # all ASCII: byte offsets are character offsets
    train_docs = [t[:c] for t, c in zip(texts, cuts)]
    val_docs = [t[c:] for t, c in zip(texts, cuts)]
    char = CharTokenizer.from_text(shakespeare_text)
    bpe = train_tokenizer_from_text(shakespeare_text[:30_000], vocab_size=300)
    for name, tok in (("char", char), ("bpe", bpe)):
        end = tok.special_tokens[ENDOFTEXT]
        prepare(paths, tok, tmp_path / name, progress=False)
        data = load_prepared(tmp_path / name)
        for split, docs in ((data.train, train_docs), (data.val, val_docs)):
            expected = tok.encode(docs[0]) + [end] + tok.encode(docs[1]) + [end] + tok.encode(docs[2])
            assert split.tolist() == expected, name
            assert tok.decode(split.tolist()) == ENDOFTEXT.join(docs)
    # A tokenizer with no end-of-text (one saved before char tokenizers had it) runs the files together.
    old = CharTokenizer(char.chars)
    prepare(paths, old, tmp_path / "old", progress=False)
    assert load_prepared(tmp_path / "old").train.tolist() == old.encode("".join(train_docs))


def test_large_vocabularies_use_uint32(tmp_path):
    class Wide(CharTokenizer):
        vocab_size = 70_000

        def encode(self, text):
            return [69_999 if c == "z" else ord(c) for c in text]

    src = tmp_path / "t.txt"
    src.write_text("az\n" * 100)
    meta = prepare([src], Wide(["a"]), tmp_path / "ds", progress=False)
    assert meta["dtype"] == "uint32"
    tokens = load_token_file(tmp_path / "ds" / "train.bin", "uint32")
    assert tokens.max() == 69_999


def test_memmap_batches_equal_tensor_batches(tmp_path):
    tokens = (np.arange(5000) % 251).astype(np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    mapped = load_token_file(tmp_path / "t.bin", "uint16")
    a = get_batch(mapped, 8, 32, generator=torch.Generator().manual_seed(1))
    b = get_batch(torch.from_numpy(tokens.astype(np.int64)), 8, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].dtype == torch.long


def test_prepare_memory_does_not_grow_with_the_corpus(tmp_path):
    line = "The quick brown fox jumps over the lazy dog; ünïcödé too.\n"
    src = tmp_path / "big.txt"
    with open(src, "w") as f:
        for _ in range(16_000_000 // len(line)):
            f.write(line)
    tok = CharTokenizer.from_text(line)
    tracemalloc.start()
    meta = prepare([src], tok, tmp_path / "ds", chunk_bytes=1 << 16, progress=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert meta["train_tokens"] + meta["val_tokens"] == len(src.read_text())
    assert peak < 4_000_000, f"peak Python allocation {peak:,} bytes for a 16 MB corpus"


def test_bad_token_data_gives_clear_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        prepare([tmp_path / "empty.txt"], CharTokenizer(["a"]), tmp_path / "ds", progress=False)
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_token_file(tmp_path / "e.bin", "uint16")
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="wrong dtype"):
        load_token_file(tmp_path / "odd.bin", "uint32")


def test_training_data_from_a_prepared_directory_or_text(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("to be or not to be\n" * 50)
    prepare([src], CharTokenizer.from_text("to be or not\n"), tmp_path / "ds", progress=False)
    from_dir = load_training_data(str(tmp_path / "ds"))
    from_text = load_training_data(str(src))
    assert isinstance(from_dir.train, np.ndarray) and isinstance(from_text.train, torch.Tensor)
    assert from_dir.tokenizer.vocab_size == from_text.tokenizer.vocab_size
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert len(from_dir.train) == meta["train_tokens"]


def test_train_on_a_text_file_splits_exactly_like_prepare(tmp_path, shakespeare_text):
    """One split rule: `train --data file.txt` (in memory) and `prepare` give the same two streams."""
    src = tmp_path / "s.txt"
    src.write_text(shakespeare_text[:30_001])  # 90% of the bytes falls inside a line
    tok = CharTokenizer.from_text(shakespeare_text[:30_001])
    prepare([src], tok, tmp_path / "ds", val_fraction=0.1, progress=False)
    prepared, in_memory = load_prepared(tmp_path / "ds"), load_training_data(str(src), val_fraction=0.1)
    assert in_memory.tokenizer.chars == tok.chars
    assert in_memory.train.tolist() == prepared.train.tolist()
    assert in_memory.val.tolist() == prepared.val.tolist()
    assert tok.decode(in_memory.val[:1].tolist()) != "\n" and tok.decode(in_memory.train[-1:].tolist()) == "\n"


def test_fetch_copies_a_verified_dataset_into_the_data_directory(tmp_path, data_dir, capsys, monkeypatch):
    """What the demo does offline: seed the data directory from a shared folder, by the one rule."""
    from glasslm.cli import main

    monkeypatch.setenv("GLASSLM_DATA_DIR", str(tmp_path / "cache"))
    assert main(["fetch", "tinyshakespeare", "--from", str(data_dir)]) == 0
    assert str(tmp_path / "cache") in capsys.readouterr().out
    assert resolve_text("tinyshakespeare") == tmp_path / "cache" / "tinyshakespeare.txt"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tinyshakespeare.txt").write_text("not shakespeare")
    assert main(["fetch", "tinyshakespeare", "--from", str(tmp_path / "bad"), "--data-dir", str(tmp_path / "c2")]) == 1
    assert "sha256" in capsys.readouterr().err
    assert not (tmp_path / "c2").exists() or not list((tmp_path / "c2").iterdir())  # nothing half-copied


def test_offline_error_states_the_rule_and_the_path(tmp_path, monkeypatch, capsys):
    import urllib.request

    from glasslm.cli import main

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setenv("GLASSLM_DATA_DIR", str(tmp_path / "d"))
    assert main(["fetch", "tinyshakespeare"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(tmp_path / "d" / "tinyshakespeare.txt") in err
    assert "--data-dir, else $GLASSLM_DATA_DIR, else ~/.cache/glasslm" in err

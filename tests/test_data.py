import hashlib

import pytest
import torch

from glasslm.data import DATASETS, fetch_dataset, get_batch, resolve_text, train_val_split


def test_batches_are_true_next_token_pairs():
    tokens = torch.arange(1000) * 7 % 1013  # distinct values, so each window is identifiable
    x, y = get_batch(tokens, 16, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 32) and x.dtype == torch.long
    for row_x, row_y in zip(x, y):
        start = int((tokens == row_x[0]).nonzero())
        assert torch.equal(row_x, tokens[start:start + 32])
        assert torch.equal(row_y, tokens[start + 1:start + 33])


def test_batches_are_reproducible_from_a_seed():
    tokens = torch.arange(500)
    a = get_batch(tokens, 4, 8, torch.Generator().manual_seed(3))
    b = get_batch(tokens, 4, 8, torch.Generator().manual_seed(3))
    c = get_batch(tokens, 4, 8, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_every_start_position_is_reachable():
    tokens = torch.arange(12)
    x, _ = get_batch(tokens, 2000, 8, torch.Generator().manual_seed(0))
    assert set(x[:, 0].tolist()) == set(range(12 - 8))


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="too small"):
        get_batch(torch.arange(8), 2, 8)


def test_split_is_ninety_ten_in_order():
    tokens = torch.arange(100)
    train, val = train_val_split(tokens)
    assert torch.equal(train, tokens[:90]) and torch.equal(val, tokens[90:])


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

"""The command line end to end: train a tiny model on a text file, sample from it, print info."""

import pytest

from glasslm.io.checkpoint import load_checkpoint
from glasslm.cli import main


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, shakespeare_text):
    root = tmp_path_factory.mktemp("cli")
    text = root / "text.txt"
    text.write_text(shakespeare_text[:20000])
    out = root / "ckpt"
    code = main(["train", "--data", str(text), "--out", str(out), "--max-steps", "30", "--eval-interval", "10",
                 "--eval-iters", "2", "--n-layers", "1", "--d-model", "32", "--n-heads", "2",
                 "--no-progress", "--sample-tokens", "20"])
    assert code == 0
    return out


def test_train_writes_a_loadable_checkpoint(tiny_run, capsys):
    model, tokenizer, meta = load_checkpoint(tiny_run)
    assert model.config.n_layers == 1 and model.config.d_model == 32
    assert model.config.vocab_size == tokenizer.vocab_size
    assert meta["step"] == 30 and meta["val_loss"] > 0


def test_sample_continues_the_prompt(tiny_run, capsys):
    assert main(["sample", "--checkpoint", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "40",
                 "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:") and len(first.rstrip("\n")) == len("ROMEO:") + 40
    main(["sample", "--checkpoint", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1"])
    assert capsys.readouterr().out == first  # a seed reproduces a sample


def test_info_prints_gpt2_small_count(capsys):
    assert main(["info", "--preset", "gpt2-small"]) == 0
    assert "124,439,808" in capsys.readouterr().out


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["sample", "--checkpoint", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 1
    with pytest.raises(SystemExit):
        main(["train", "--d-model", "not-a-number"])


def test_train_tokenizer_then_prepare(tmp_path, shakespeare_text, capsys):
    import numpy as np

    from glasslm.data import load_prepared

    text = tmp_path / "t.txt"
    text.write_text(shakespeare_text[:30000])
    assert main(["train-tokenizer", str(text), "--vocab-size", "400", "--out", str(tmp_path / "tok"),
                 "--workers", "1"]) == 0
    assert main(["prepare", str(text), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "ds"),
                 "--quiet"]) == 0
    data = load_prepared(tmp_path / "ds")
    assert data.tokenizer.vocab_size == 400  # bytes, merges and <|endoftext|> together
    assert data.train.dtype == np.uint16
    assert data.tokenizer.decode(np.concatenate([data.train, data.val]).tolist()) == shakespeare_text[:30000]
    assert main(["train", "--data", str(tmp_path / "ds"), "--out", str(tmp_path / "run"), "--max-steps", "5",
                 "--eval-iters", "1", "--n-layers", "1", "--d-model", "32", "--n-heads", "2",
                 "--no-progress", "--sample-tokens", "5"]) == 0
    model, tokenizer, _ = load_checkpoint(tmp_path / "run")
    assert model.config.vocab_size == tokenizer.vocab_size == 400
    assert main(["prepare", str(text), "--out", str(tmp_path / "char"), "--quiet"]) == 0
    char = load_prepared(tmp_path / "char").tokenizer  # the characters, then <|endoftext|>
    assert char.vocab_size == len(set(shakespeare_text[:30000])) + 1
    assert char.special_tokens == {"<|endoftext|>": char.vocab_size - 1}

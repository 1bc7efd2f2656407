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


def test_the_executable_freezes_what_its_imports_made_and_importing_the_cli_does_not():
    """`glasslm` (glasslm.__main__.run) imports the command line with the cycle collector off and freezes
    what that made, so that neither the command nor the interpreter's exit walks those objects again;
    a library's `import glasslm.cli` freezes nothing. Either way the collector is on while a command runs."""
    import subprocess
    import sys

    probe = ("import atexit, gc, sys\n"
             "atexit.register(lambda: print('frozen', gc.get_freeze_count(), 'tracked', len(gc.get_objects()),"
             " 'enabled', gc.isenabled()))\n")
    entry = probe + "sys.argv = ['glasslm', 'info', '--preset', 'llama-tiny']\nfrom glasslm.__main__ import run\nrun()\n"
    library = probe + "import glasslm.cli\n"
    results = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
               for code in (entry, library)]
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert results[0].stdout.startswith("llama-tiny: ")  # the command itself ran
    (_, frozen, _, _, _, entry_on), (_, not_frozen, _, tracked, _, library_on) = (
        r.stdout.split()[-6:] for r in results)
    assert (entry_on, library_on) == ("True", "True")
    assert int(not_frozen) == 0
    assert int(frozen) > int(tracked) // 2  # (most of what importing torch and glasslm.cli leaves tracked)

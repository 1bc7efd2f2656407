"""What a newcomer meets in the first hour (issue 26): help that shows use, and messages that are
true and whose advice works."""

import shutil

import pytest

from glasslm.cli import COMMANDS, build_parser, main
from glasslm.presets import get_preset
from glasslm.training.config import get_recipe


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


def test_top_level_help_shows_commands_to_type_not_implementation(capsys):
    text = _help(capsys)
    assert "glasslm train" in text and "glasslm generate --checkpoint" in text
    assert "dataclass" not in text


@pytest.mark.parametrize("name", [c.name for c in COMMANDS if not c.subcommands] + ["generate"])
def test_each_command_opens_its_help_with_a_short_usage_and_examples(capsys, name):
    text = _help(capsys, name)
    usage, rest = text.split("\n", 1)
    assert usage.startswith(f"usage: glasslm {name} ") and usage.endswith("[options]")
    assert "examples:\n  glasslm " in rest and rest.index("examples:") < rest.index("\noptions:")


def test_train_help_shows_the_defaults_that_train(capsys):
    text = " ".join(_help(capsys, "train").split())  # argparse wraps lines
    recipe, model = get_recipe("shakespeare-char-cpu"), get_preset("shakespeare-char-cpu")
    assert f"--max-steps INT optimizer steps in the whole run (a resumed run continues up to it) " \
           f"(default: {recipe.max_steps})" in text
    assert f"(default: {recipe.optimizer})" in text
    d_model = text.split("--d-model INT", 1)[1].split("--", 1)[0]
    assert f"(default: {model.d_model})" in d_model
    context = text.split("--context-length INT", 1)[1].split("--", 1)[0]
    assert f"(default: {model.context_length})" in context


def test_booleans_are_flags_in_help(capsys):
    text = _help(capsys, "info")
    assert "--bias, --no-bias" in text and "[MODELCONFIG" not in text


def test_a_bad_choice_is_one_short_error_not_pages_of_usage(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["info", "--preset", "gpt3"])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 2 and "gpt2-small" in err


def test_a_file_given_as_checkpoint_is_called_a_file(tmp_path, capsys):
    (tmp_path / "random.txt").write_text("hi")
    assert main(["info", "--checkpoint", str(tmp_path / "random.txt")]) == 1
    err = capsys.readouterr().err
    assert "is a file; a checkpoint is a directory" in err and "does not exist" not in err


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main(["info", "--checkpoint", "runs/nonexist"]) == 1
    err = capsys.readouterr().err
    assert "runs/nonexist does not exist" in err and "download" not in err
    assert main(["info", "--checkpoint", "someorg/somemodel"]) == 1  # no such local folder: both readings named
    err = capsys.readouterr().err
    assert "`glasslm download someorg/somemodel`" in err and "local path" in err


@pytest.mark.slow  # two short training runs
def test_resuming_a_copied_checkpoint_asks_for_out_and_leaves_its_parent_alone(tmp_path, shakespeare_text, capsys):
    text = tmp_path / "text.txt"
    text.write_text(shakespeare_text[:5000])
    run = tmp_path / "run"
    assert main(["train", "--data", str(text), "--out", str(run), "--max-steps", "2", "--eval-interval", "2",
                 "--eval-iters", "1", "--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--no-progress",
                 "--sample-tokens", "0"]) == 0
    parent = tmp_path / "copies"
    parent.mkdir()
    shutil.copytree(run / "ckpt-000002", parent / "mine")
    capsys.readouterr()
    assert main(["train", "--resume", str(parent / "mine"), "--max-steps", "3", "--no-progress",
                 "--sample-tokens", "0"]) == 1
    err = capsys.readouterr().err
    assert "outside a run directory" in err and "--out DIR" in err
    assert sorted(p.name for p in parent.iterdir()) == ["mine"]  # no lock, pointers or metrics
    # The advice works: with --out it continues there.
    assert main(["train", "--resume", str(parent / "mine"), "--max-steps", "3", "--no-progress",
                 "--sample-tokens", "0", "--out", str(tmp_path / "continued")]) == 0
    assert (tmp_path / "continued" / "ckpt-000003").is_dir()


CHARS = "\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _checkpoint(path, preset="shakespeare-char-cpu", meta=None, **overrides):
    import torch

    from glasslm.core.model import TransformerLM
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.tokenizers import CharTokenizer

    tok = CharTokenizer(list(CHARS))
    torch.manual_seed(0)
    config = get_preset(preset, vocab_size=tok.vocab_size, **overrides)
    return save_checkpoint(path, TransformerLM(config), tok, meta), tok


@pytest.mark.slow  # speculative decoding of 53 tokens
def test_draft_with_the_default_new_tokens_fits_a_context_64_model(tmp_path, capsys):
    from glasslm.generation import GenerationConfig, generate
    from glasslm.io.checkpoint import load_checkpoint

    path, tok = _checkpoint(tmp_path / "target", n_layers=1, d_model=32, n_heads=2)
    assert main(["generate", "--checkpoint", str(path), "--draft", str(path), "--temperature", "0",
                 "--prompt", "ROMEO:"]) == 0  # the default --max-new-tokens (256) cannot fit in 64
    out, err = capsys.readouterr()
    fits = 64 - len("ROMEO:") - 4 - 1  # context - prompt - lookahead - 1
    assert f"[--draft: {fits} new tokens, not 256" in err
    model, _, _ = load_checkpoint(path)
    greedy = generate(model, [tok.encode("ROMEO:")], GenerationConfig(max_new_tokens=fits, temperature=0.0))
    assert out == "ROMEO:" + tok.decode(greedy[0].tokens) + "\n"


def test_zero_biases_on_a_model_without_missing_biases_is_refused(tmp_path, capsys):
    path, _ = _checkpoint(tmp_path / "llama", preset="llama-tiny", context_length=64)
    assert main(["convert", "--to-hf", "--checkpoint", str(path), "--out", str(tmp_path / "hf"), "--zero-biases"]) == 1
    err = capsys.readouterr().err
    assert "--zero-biases" in err and "no missing biases" in err and "drop --zero-biases" in err
    assert not (tmp_path / "hf").exists()
    assert main(["convert", "--to-hf", "--checkpoint", str(path), "--out", str(tmp_path / "hf")]) == 0


def test_an_hf_export_has_no_local_paths_and_info_does_not_call_it_converted_from_itself(tmp_path, capsys):
    data = tmp_path / "private" / "my_text.txt"
    path, _ = _checkpoint(tmp_path / "llama", preset="llama-tiny", context_length=64,
                          meta={"data": str(data), "converted_from": f"nanogpt:{tmp_path}/out/ckpt.pt"})
    hf = tmp_path / "hf"
    assert main(["convert", "--to-hf", "--checkpoint", str(path), "--out", str(hf)]) == 0
    card = (hf / "README.md").read_text()
    assert str(tmp_path) not in card
    assert "| training data | my_text.txt |" in card and "| converted from | nanogpt:ckpt.pt |" in card
    capsys.readouterr()
    assert main(["info", "--checkpoint", str(hf)]) == 0
    assert "converted" not in capsys.readouterr().out


def test_threads_help_speaks_of_the_command_not_library_internals(capsys):
    text = " ".join(_help(capsys, "train").split())
    threads = text.split("--threads INT", 1)[1].split(" --", 1)[0]
    assert "CPU threads for training" in threads and "train()" not in threads


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`glasslm info | head`: the reader closes the pipe; glasslm stops without an error, as Unix tools do."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "glasslm.cli", "info", "--preset", "gpt2-xl"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before glasslm writes a line: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""  # 128 + SIGPIPE, as `head`'s writers end


def test_prepare_without_the_data_extra_prints_only_the_message(tmp_path, monkeypatch, capsys):
    """Issue 47: a missing optional package is one line naming what to install, not a traceback."""
    import sys

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"text": "hello"}\n')
    for name in ("pyarrow", "pyarrow.json", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # `import pyarrow` now raises ImportError
    assert main(["prepare", str(tmp_path / "corpus" / "*.jsonl"), "--tokenizer", "char", "--out",
                 str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("glasslm prepare: error: reading JSONL needs pyarrow") and "pip install -e '.[data]'" in err

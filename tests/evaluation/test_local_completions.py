"""lm-evaluation-harness's own `local-completions` model against a running `glasslm serve`, on the local
multiple-choice, rolling-perplexity and generate-until tasks of test_harness.py, compared with glasslm's
in-process harness on the same model: accuracy and generations identical, log-likelihoods within 1e-4
(relative 1e-6 for long sums). Token-id prompts (tokenized_requests=True) and text prompts both."""

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from glasslm.evaluation.harness import GlassLMEval, evaluate_tasks  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402

from test_harness import TASKS, _per_sample, _scores, exported  # noqa: E402,F401


def _served_results(url, folder, model, tokenized: bool, prefix: int):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # max_length: lm-eval sends prompts of up to max_length - 1 tokens (it keeps one for the answer),
    # so the context length + 1 lets a prompt fill the model's whole context.
    args = (f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={folder / 'hf'},"
            f"max_length={model.config.context_length + 1},tokenized_requests={tokenized},"
            f"prefix_token_id={prefix},batch_size=4,max_retries=1")
    return simple_evaluate(model="local-completions", model_args=args, tasks=sorted(TASKS),
                           task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                           random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-4) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def in_process(exported):
    """glasslm's in-process harness results: all three tasks, and the rolling task on the API's windows."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model, tokenizer, folder = exported
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        ours = evaluate_tasks(model, tokenizer, sorted(TASKS), include_path=folder, log_samples=True)
        # lm-eval cuts rolling windows one token shorter for an API model (one token kept for the
        # answer), so the same windows in process take a harness model with max_length one less.
        windowed = GlassLMEval(model, tokenizer, batch_size=4)
        windowed.max_length = model.config.context_length - 1
        rolling = simple_evaluate(model=windowed, tasks=["tiny_rolling"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(folder)), random_seed=1234,
                                  numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)
    return ours, rolling, windowed.prefix_token_id


@pytest.mark.slow
@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_eval_local_completions_against_glasslm_serve_equals_the_in_process_harness(exported, in_process,
                                                                                        monkeypatch, tokenized):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer, folder = exported
    ours, rolling, prefix = in_process
    app = create_app(model, tokenizer, ServeConfig(name="tiny", max_batch=8))
    with serving_in_thread(app) as url:
        served = _served_results(url, folder, model, tokenized, prefix)
    assert app.state.engine.stats["largest_batch"] > 1  # lm-eval's batches of 4 prompts decoded together
    assert served["results"]["tiny_choice"]["acc,none"] == ours["results"]["tiny_choice"]["acc,none"]
    assert _close(_scores(served, "tiny_choice"), _scores(ours, "tiny_choice"))
    assert _close(_scores(served, "tiny_rolling"), _scores(rolling, "tiny_rolling"))
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(served["results"]["tiny_rolling"][metric], rolling["results"]["tiny_rolling"][metric],
                            rel_tol=1e-5)
    assert _per_sample(served, "tiny_until") == _per_sample(ours, "tiny_until")
    for task, reference in (("tiny_choice", ours), ("tiny_rolling", rolling)):  # the figures, for the record (-s)
        gaps = [abs(x - y) for x, y in zip(_scores(served, task), _scores(reference, task))]
        print(f"{task} tokenized_requests={tokenized}: {len(gaps)} log-likelihoods, max |served - in process| "
              f"{max(gaps):.2e}")


def documented_lm_eval_lines() -> list[str]:
    """Every `lm_eval ...` command of the README and docs, lines continued with a backslash joined
    (tests/doc_commands.py counts these as run here)."""
    return [line for line, _ in _documented_lm_eval_lines_and_servers()]


def _documented_lm_eval_lines_and_servers() -> list[tuple[str, str | None]]:
    """(each `lm_eval ...` line, the checkpoint of the last `glasslm serve --checkpoint X` line above it
    on its page: the server the docs start for it)."""
    root = Path(__file__).resolve().parents[2]
    found: list[tuple[str, str | None]] = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8").replace("\\\n", " ")
        served = None
        for line in text.splitlines():
            if line.startswith("glasslm serve --checkpoint "):
                served = shlex.split(line, comments=True)[3]
            if line.startswith("lm_eval "):
                found.append((line, served))
    return found


def _documented_lm_eval_commands() -> list[tuple[list[str], str | None]]:
    return [(shlex.split(line, comments=True), served) for line, served in _documented_lm_eval_lines_and_servers()]


def _here(words: list[str], url: str, folder: Path) -> list[str]:
    """A documented command aimed at this test's server, tasks and HF export (everything else as written)."""
    args = list(words[1:])
    args[args.index("--tasks") + 1] = "tiny_choice,tiny_until"
    at = args.index("--model_args") + 1
    args[at] = re.sub(r"base_url=http://[^/,]+", f"base_url={url}", args[at])
    args[at] = re.sub(r"tokenizer=runs/[^,]+", f"tokenizer={folder / 'hf'}", args[at])  # the docs' HF export
    return [*args, "--include_path", str(folder)]


@pytest.mark.slow
def test_every_documented_lm_eval_command_runs_against_glasslm_serve(exported):
    # lm-eval 0.4.13 refused the README's command while it put batch_size=8 inside --model_args.
    # Issue 47: the docs said model=char to a server that `glasslm serve --checkpoint runs/shakespeare-char-cpu`
    # names after its checkpoint, which answered 404; each line now meets the server as the docs start it.
    from glasslm.cli.serve import served_name

    commands = _documented_lm_eval_commands()
    assert len(commands) >= 3  # the README's, and docs/serving.md's two (remote and Hugging Face tokenizers)
    model, tokenizer, folder = exported
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    for words, served in commands:
        assert words[0] == "lm_eval" and "--batch_size" in words, words
        assert served is not None, f"no `glasslm serve --checkpoint` line above {' '.join(words)}"
        config = ServeConfig(name=served_name(served), max_batch=8)  # the name `glasslm serve` gives it
        with serving_in_thread(create_app(model, tokenizer, config)) as url:
            run = subprocess.run([sys.executable, "-m", "lm_eval", *_here(words, url, folder)], env=env,
                                 capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, (words, run.stderr[-3000:])
        assert "tiny_choice" in run.stdout and "tiny_until" in run.stdout, run.stdout[-2000:]

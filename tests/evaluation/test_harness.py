"""glasslm's lm-eval model against lm-eval's own `--model hf` on the same weights exported to
Hugging Face format: multiple-choice, rolling-perplexity and generate-until tasks, all offline on
task YAMLs over data the test writes."""

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.evaluation.harness import evaluate_tasks  # noqa: E402
from glasslm.hf import export_hf  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.tokenizers import train_tokenizer_from_text  # noqa: E402

TEXT = ("the cat sat on the mat. the dog ran to the park. a bird sang in the tree. "
        "one two three four five six seven eight nine ten. ") * 20

TASKS = {
    "tiny_choice": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "tiny_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
    "tiny_until": """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def _write_tasks(folder: Path) -> None:
    rows = [{"question": f"the {a} sat on the", "choices": [" mat", " park", " tree", " cat"], "answer": i % 4,
             "text": f"the {a} ran to the park. one two three. " * (3 + i), }
            for i, a in enumerate(["cat", "dog", "bird", "one", "two", "three"])]
    (folder / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, body in TASKS.items():
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
            f"test_split: test\n{body}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harness")
    tokenizer = train_tokenizer_from_text(TEXT, vocab_size=300)
    torch.manual_seed(0)
    config = get_preset("llama-tiny", vocab_size=tokenizer.vocab_size, context_length=64, n_layers=2)
    model = TransformerLM(config).eval()
    with torch.no_grad():  # sharper predictions than the tiny init, so choices are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    export_hf(model, folder / "hf", tokenizer)
    _write_tasks(folder)
    return model, tokenizer, folder


def _per_sample(results, task):
    return [s["resps"] for s in results["samples"][task]]


def _scores(results, task) -> list[float]:
    """Every log-likelihood lm-eval recorded for `task`, in order (greedy flags left out)."""
    def walk(value):
        if isinstance(value, (list, tuple)):
            for item in value:
                yield from walk(item)
        elif isinstance(value, float):
            yield value
    return list(walk(_per_sample(results, task)))


@pytest.mark.slow
def test_glasslm_and_hf_routes_agree_on_every_task(exported, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer, folder = exported
    tasks = sorted(TASKS)
    ours = evaluate_tasks(model, tokenizer, tasks, include_path=folder, log_samples=True)
    theirs = simple_evaluate(model="hf", model_args=f"pretrained={folder / 'hf'},dtype=float32", device="cpu", tasks=tasks,
                             task_manager=TaskManager(include_path=str(folder)), log_samples=True, batch_size=4,
                             random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234,
                             fewshot_random_seed=1234)
    assert ours["results"]["tiny_choice"]["acc,none"] == theirs["results"]["tiny_choice"]["acc,none"]
    for task in ("tiny_choice", "tiny_rolling"):
        a, b = _scores(ours, task), _scores(theirs, task)
        assert len(a) == len(b) > 0
        # Sums over up to a few hundred tokens: float32 rounding grows with the sum, so relative too.
        assert all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-4) for x, y in zip(a, b)), (task, a, b)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(ours["results"]["tiny_rolling"][metric], theirs["results"]["tiny_rolling"][metric],
                            rel_tol=1e-5)
    assert _per_sample(ours, "tiny_until") == _per_sample(theirs, "tiny_until")


@pytest.mark.slow  # lm-eval reads every task definition it ships (~6 s)
def test_an_unknown_task_is_named(exported):
    model, tokenizer, folder = exported
    with pytest.raises(ValueError, match="unknown lm-eval task.*tiny_chioce"):
        evaluate_tasks(model, tokenizer, ["tiny_chioce"], include_path=folder)


@pytest.mark.slow
def test_evaluating_leaves_the_callers_random_streams_alone(exported):
    import random

    import numpy as np

    model, tokenizer, folder = exported
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    results = evaluate_tasks(model, tokenizer, ["tiny_choice"], include_path=folder, limit=2)
    assert 0.0 <= results["results"]["tiny_choice"]["acc,none"] <= 1.0
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]


@pytest.mark.slow
def test_cli_eval_tasks_prints_the_table_and_writes_the_results(exported, tmp_path, capsys):
    from glasslm.cli import main
    from glasslm.io.checkpoint import save_checkpoint

    model, tokenizer, folder = exported
    checkpoint = save_checkpoint(tmp_path / "ckpt", model, tokenizer)
    out = tmp_path / "results.json"
    assert main(["eval", "--checkpoint", str(checkpoint), "--tasks", "tiny_choice,tiny_rolling", "--include-path",
                 str(folder), "--limit", "4", "--batch-size", "4", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tiny_choice" in printed and "tiny_rolling" in printed and "|" in printed  # lm-eval's table
    written = json.loads(out.read_text())["results"]
    direct = evaluate_tasks(model, tokenizer, ["tiny_choice", "tiny_rolling"], include_path=folder, limit=4)["results"]
    assert written["tiny_choice"]["acc,none"] == direct["tiny_choice"]["acc,none"]
    assert written["tiny_rolling"]["word_perplexity,none"] == pytest.approx(direct["tiny_rolling"]["word_perplexity,none"],
                                                                           rel=1e-6)


def test_cli_eval_tasks_without_the_extra_says_what_to_install(exported, tmp_path, capsys, monkeypatch):
    import sys

    from glasslm.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "tiny_choice"]) == 1
    assert "pip install lm-eval" in capsys.readouterr().err

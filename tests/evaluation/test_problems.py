"""`glasslm eval --problems`: greedy answers written in ragged batches are each what decoding that
prompt alone writes, scored by the reward GRPO trains with; the accuracy printed is the share of
problems whose answer (one prompt at a time, by hand) ends with the expected word; bad problem files
and rewards are refused with one line before any answer is written."""

from __future__ import annotations

import json
import re

import pytest
import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.data.problems import load_problems
from glasslm.evaluation.problems import score_problems
from glasslm.evaluation.rewards import load_reward
from glasslm.generation import eos_ids, generate_tokens
from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer

TEMPLATE = "{% for m in messages %}u:{{ m['content'] }};{% endfor %}a:"
TOKENIZER = CharTokenizer.from_text("abcdefgh xyz0123456789u:;.")
PROMPTS = ["abc", "hg", "dddd", "e", "fab", "ggh", "a b", "cc"]  # ragged: 2 to 7 prompt tokens after the template


def _answers_alone(model, prompts, max_new_tokens):
    """Each prompt's greedy answer decoded by itself, one token at a time, up to the end-of-text token."""
    stops = eos_ids(model, TOKENIZER)
    return [TOKENIZER.decode(list(generate_tokens(model, TOKENIZER.encode(f"u:{p};a:"), max_new_tokens=max_new_tokens,
                                                  temperature=0.0, stop_tokens=stops))) for p in prompts]


@pytest.fixture
def problems(tmp_path):
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=TOKENIZER.vocab_size, context_length=48, n_layers=2)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # peaked: answers that differ from prompt to prompt
    alone = _answers_alone(model, PROMPTS, 6)
    assert len(set(alone)) > 2
    # half the answers expected are the model's own last word without punctuation (right), half not (wrong)
    last_words = [(a.split() or [""])[-1].strip(".;:") for a in alone]
    expected = [w if i % 2 == 0 and w else "zzz" for i, w in enumerate(last_words)]
    right = sum(e != "zzz" for e in expected)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": e}) + "\n"
                                              for p, e in zip(PROMPTS, expected)))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    save_checkpoint(tmp_path / "model", model, TOKENIZER)
    return tmp_path, model, alone, right


def test_batched_greedy_answers_are_each_prompts_own_and_scored_by_the_reward(problems):
    folder, model, alone, right = problems
    encoded = load_problems(folder / "p.jsonl", TOKENIZER, TEMPLATE)
    result = score_problems(model, TOKENIZER, encoded, load_reward("exact_match"), max_new_tokens=6, batch_size=3)
    assert [a.completion for a in result.answers] == alone
    assert result.accuracy == pytest.approx(right / len(PROMPTS)) and right >= 2
    assert [a.reward for a in result.answers][1::2] == [0.0] * 4


def test_cli_eval_problems_prints_the_accuracy_and_writes_each_answer(problems, capsys):
    folder, _, alone, right = problems
    args = ["eval", "--checkpoint", str(folder / "model"), "--problems", str(folder / "p.jsonl"), "--chat-template",
            str(folder / "t.jinja"), "--max-new-tokens", "6", "--batch-size", "5", "--device", "cpu",
            "--output", str(folder / "scores.json"), "--show", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(rf"accuracy {right / len(PROMPTS):.4f} \({right}/{len(PROMPTS)} with reward 1\)", out)
    assert out.count("expected") == 2
    saved = json.loads((folder / "scores.json").read_text())
    assert [a["completion"] for a in saved["answers"]] == alone and saved["reward"] == "exact_match"
    assert main([*args[:-4], "--limit", "3"]) == 0
    assert "(3 problems;" in capsys.readouterr().out


@pytest.mark.parametrize("records, reward, message", [
    ([{"prompt": "abc", "answer": "a"}, {"prompt": "hg"}], "exact_match",
     "1 of 2 problems have no 'answer' field \\(the first: problem 2\\); --reward exact_match"),
    ([{"answer": "a"}], "exact_match", ":1: missing field 'prompt'"),
    ([{"prompt": "abc"}], "broken.py:score", "running .*broken.py failed: SyntaxError"),
    ([{"prompt": "abc"}], "glasslm_no_such_rewards:score", "cannot import 'glasslm_no_such_rewards'"),
])
def test_bad_problems_and_rewards_are_refused_in_one_line(problems, capsys, records, reward, message):
    folder = problems[0]
    (folder / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "broken.py").write_text("def score(prompt, completion)\n    return 1.0\n")
    spec = str(folder / reward) if reward.startswith("broken") else reward
    code = main(["eval", "--checkpoint", str(folder / "model"), "--problems", str(folder / "bad.jsonl"), "--reward", spec,
                 "--chat-template", str(folder / "t.jinja"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code != 0 and re.search(message, err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1

"""The demo's model as the README goes on to use it (issue 32): the quantized perplexities the README
and docs/generation.md quote are what this version gives, and a LoRA fine-tune with the default
settings on the shipped chat example learns its answers and stops after them in `glasslm chat`."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from glasslm.cli import main
from glasslm.data.sft import read_conversations, split_examples
from glasslm.training.config import TrainConfig

pytestmark = pytest.mark.slow  # trains the demo model (300 steps: about half a minute on one core)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "chat"


@pytest.fixture(scope="module")
def demo(tmp_path_factory, data_dir):
    """What `bash scripts/demo.sh` trains, by its own command (on one thread: the fastest for a model
    this small on a busy machine; another thread count changes only the last bits)."""
    out = tmp_path_factory.mktemp("demo") / "shakespeare-char-cpu"
    assert main(["train", "--preset", "shakespeare-char-cpu", "--data", "tinyshakespeare", "--out", str(out),
                 "--no-progress", "--threads", "1"]) == 0
    return out


def _perplexity(checkpoint: Path, quantize: str, capsys) -> float:
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(checkpoint), "--data", "tinyshakespeare", "--quantize", quantize,
                 "--quiet", "--threads", "1"]) == 0
    return float(re.search(r"perplexity ([\d.]+)", capsys.readouterr().out).group(1))


def test_the_quantized_perplexities_the_pages_quote_are_this_versions(demo, capsys):
    readme = " ".join((ROOT / "README.md").read_text().split())
    generation = " ".join((ROOT / "docs" / "generation.md").read_text().split())
    int4, fp32 = map(float, re.search(r"the demo model's val perplexity ([\d.]+) against ([\d.]+) in fp32",
                                      readme).groups())
    quoted = re.search(r"scored val perplexity ([\d.]+) against ([\d.]+) \(fp32\) and ([\d.]+) \(int8\)"
                       r" when trained on a 2-core (AMD EPYC|Intel Xeon)", generation)
    assert quoted, "docs/generation.md quotes the demo model's perplexities and names the CPU it trained on"
    assert (int4, fp32) == tuple(map(float, quoted.groups()[:2]))  # the two pages agree
    measured = {q: _perplexity(demo, q, capsys) for q in ("none", "int8", "int4")}
    # What holds on every machine: the bounds the pages state for each quantization (int8 within 1% of
    # fp32, int4 within 3%). The quoted figures are one CPU's training run: another CPU kind rounds
    # differently, and a 300-step run carries that on (int4 cost 0.83% on an AMD EPYC, 0.44% on an
    # Intel Xeon), so they are held only to 2%, which catches a page left behind by a recipe change.
    assert measured["int8"] / measured["none"] == pytest.approx(1, abs=0.01)
    assert measured["int4"] / measured["none"] == pytest.approx(1, abs=0.03)
    assert measured["none"] == pytest.approx(fp32, rel=0.02)
    assert measured["int4"] == pytest.approx(int4, rel=0.02)


@pytest.fixture(scope="module")
def fine_tuned(demo, tmp_path_factory):
    """README: finetune the demo's run on examples/chat with no method or training options."""
    data, template = EXAMPLES / "shakespeare.jsonl", EXAMPLES / "template.jinja"
    out = tmp_path_factory.mktemp("ft") / "ft"
    assert main(["finetune", "--checkpoint", str(demo), "--data", str(data), "--chat-template", str(template),
                 "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    return out


def _chat_answers(checkpoint: Path, capsys, monkeypatch) -> tuple[int, int, list]:
    """(right, asked, pairs) of greedy answers to 12 of finetune's training prompts; each must have ended
    at the eos (within the default token limit: lines beyond would be a run-on answer's)."""
    conversations = read_conversations(EXAMPLES / "shakespeare.jsonl")
    trained, _ = split_examples(conversations, 0.1, seed=TrainConfig().seed)  # finetune's own split
    asked = trained[:12]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{c[0]['content']}\n/reset\n" for c in asked)))
    capsys.readouterr()
    assert main(["chat", "--checkpoint", str(checkpoint), "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    answers = [line for line in out.splitlines() if line != "[conversation reset]"]
    lengths = [int(n) for n in re.findall(r"^\[(\d+) tokens in", err, re.MULTILINE)]
    assert len(answers) == len(lengths) == len(asked) and max(lengths) < 100  # each ended at the eos
    right = sum(answer == c[1]["content"] for answer, c in zip(answers, asked))
    return right, len(asked), list(zip(answers, [c[1]["content"] for c in asked]))


def test_a_default_lora_finetune_of_the_demo_model_answers_and_stops(fine_tuned, capsys, monkeypatch):
    """README: chat with the fine-tuned model: it answers training prompts and stops after each answer."""
    right, asked, pairs = _chat_answers(fine_tuned, capsys, monkeypatch)
    assert right >= 0.75 * asked, pairs


def test_a_default_dpo_run_on_the_fine_tuned_demo_model_keeps_it_answering(fine_tuned, tmp_path, capsys, monkeypatch):
    """Issue 47: DPO with the defaults of then (1,000 steps at lr 3e-3) drove the loss to 0 and the chosen
    rewards to -8.6 while the progress showed only the loss, and chat answered garbage. README's DPO line
    now runs 3 passes at a third of LoRA's rate, on the LoRA run's adapters merged into their base: the
    margin rises, progress shows the rewards, and chat still answers and stops."""
    assert main(["finetune", "--checkpoint", str(fine_tuned), "--method", "dpo", "--data",
                 str(EXAMPLES / "shakespeare-prefs.jsonl"), "--out", str(tmp_path / "dpo"), "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert "holds LoRA adapters" in out and "warning: step" not in err
    assert all(f"{name}=" in err for name in ("chosen", "rejected", "margin", "accuracy"))
    records = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "rewards/margins" in r]
    assert trained[-1]["rewards/margins"] > 0.1 and trained[-1]["rewards/accuracies"] >= 0.75
    assert trained[-1]["logps/chosen_change_per_token"] > -0.1  # the chosen answers kept their probability
    right, asked, pairs = _chat_answers(tmp_path / "dpo", capsys, monkeypatch)
    assert right >= 0.75 * asked, pairs

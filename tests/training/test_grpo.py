"""GRPO: the loss on one batch of sampled completions against TRL's GRPOTrainer._compute_loss (same
samples, masks, sampling-policy and reference log-probabilities, advantages, weights), the group
advantages against TRL's normalisation, and the per-token log-probabilities against TRL's."""

from __future__ import annotations

import json

import pytest
import torch

from chat_models import hf_llama, hf_tokenizer
from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.data.problems import load_problems, read_problems
from glasslm.data.sft import IGNORE_INDEX, SFTExample, padded_batch
from glasslm.io.checkpoint import resolve_checkpoint, save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer
from glasslm.training.grpo import completion_log_probs, group_advantages, grpo_loss
from glasslm.training.plot import signals_logged
from glasslm.evaluation.rewards import load_reward, score


pytestmark = pytest.mark.usefixtures("one_thread")


def _trl_trainer(model: str, tmp_path, beta: float, epsilon: float, group_size: int, temperature: float = 1.0):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, beta=beta, epsilon=epsilon,
                      num_generations=group_size, per_device_train_batch_size=4, max_completion_length=8,
                      save_strategy="no", bf16=False, temperature=temperature)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                       train_dataset=Dataset.from_list([{"prompt": "ab"}] * 4), processing_class=hf_tokenizer())


PROMPTS = [[5, 7, 9], [5, 7, 9], [11, 12], [11, 12]]  # two prompts, a group of two completions each
COMPLETIONS = [[13, 14, 15, 2], [16, 2], [17, 18, 19, 20, 21], [22]]


def _trl_inputs(old, reference, advantages):
    """TRL's batch layout: prompts left-padded, completions right-padded, per-token tensors over the completions."""
    width_p, width_c = max(map(len, PROMPTS)), max(map(len, COMPLETIONS))
    prompt_ids = torch.tensor([[0] * (width_p - len(p)) + p for p in PROMPTS])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in PROMPTS])
    completion_ids = torch.tensor([c + [0] * (width_c - len(c)) for c in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in COMPLETIONS])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
            "ref_per_token_logps": reference, "num_items_in_batch": completion_mask.sum()}


def _ours_to_trl(per_token: torch.Tensor) -> torch.Tensor:
    """glasslm's layout (rows right-padded, the completion's log-probs at its label positions) as TRL's."""
    width_c = max(map(len, COMPLETIONS))
    out = torch.zeros(len(PROMPTS), width_c, dtype=per_token.dtype)
    for row, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        out[row, :len(c)] = per_token[row, len(p) - 1:len(p) - 1 + len(c)]
    return out


def _trl_to_ours(per_token: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(len(PROMPTS), width, dtype=per_token.dtype)
    for row, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        out[row, len(p) - 1:len(p) - 1 + len(c)] = per_token[row, :len(c)]
    return out


def _our_batch():
    examples = [SFTExample(p + c, [IGNORE_INDEX] * (len(p) - 1) + c + [IGNORE_INDEX]) for p, c in zip(PROMPTS, COMPLETIONS)]
    return padded_batch(examples, 128)


@pytest.mark.parametrize("beta, temperature", [(0.04, 1.0), (0.0, 1.0), (0.04, 0.7)])
def test_the_loss_equals_trls_on_the_same_samples(tmp_path, beta, temperature):
    """At a sampling temperature T both score the tokens under softmax(logits / T), the distribution sampled."""
    from glasslm.hf import load_model

    epsilon = 0.2
    hf_llama(0).save_pretrained(tmp_path / "policy")
    hf_tokenizer().save_pretrained(tmp_path / "policy")
    policy, _ = load_model(tmp_path / "policy")
    trainer = _trl_trainer(str(tmp_path / "policy"), tmp_path, beta, epsilon, group_size=2,
                           temperature=temperature)  # its reference: the same file
    x, y = _our_batch()
    ours = completion_log_probs(policy(x), y, temperature)                               # (rows, width)
    trl_inputs = _trl_inputs(None, None, None)
    with torch.no_grad():
        trl_logps, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([trl_inputs["prompt_ids"], trl_inputs["completion_ids"]], 1),
            torch.cat([trl_inputs["prompt_mask"], trl_inputs["completion_mask"]], 1),
            trl_inputs["completion_ids"].shape[1])[:2]
    mask = trl_inputs["completion_mask"].bool()
    assert torch.allclose(_ours_to_trl(ours.detach())[mask], trl_logps[mask], atol=1e-5)

    torch.manual_seed(3)  # a sampling policy and a reference that differ from the policy: ratios clip, KL > 0
    old = trl_logps + torch.randn_like(trl_logps) * 0.3
    reference = trl_logps + torch.randn_like(trl_logps) * 0.5
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9])
    advantages = group_advantages(rewards, group_size=2)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets for an unaccumulated step
    trl_loss = trainer._compute_loss(trainer.model, _trl_inputs(old, reference, advantages))
    loss, stats = grpo_loss(ours, _trl_to_ours(old, x.shape[1]), _trl_to_ours(reference, x.shape[1]), advantages,
                            y != IGNORE_INDEX, epsilon, beta)
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5)
    assert stats["clip_ratio"].item() > 0  # the clipping took part in the comparison
    if beta:
        assert stats["kl"].item() == pytest.approx(trainer._metrics["train"]["kl"][-1], rel=1e-4)


def test_the_group_advantages_are_trls_normalisation():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 0.5, 0.5, 2.0, -1.0])
    groups = rewards.view(-1, 4)
    expected = (groups - groups.mean(1, keepdim=True)) / (nanstd(groups, dim=1).unsqueeze(1) + 1e-4)
    assert torch.allclose(group_advantages(rewards, 4), expected.reshape(-1))
    assert torch.equal(group_advantages(torch.full((4,), 0.7), 2), torch.zeros(4))  # no signal, no step
    with pytest.raises(ValueError, match="groups"):
        group_advantages(rewards, 3)


# ----- rewards and problem records -----

def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_the_built_in_rewards():
    exact = load_reward("exact_match")
    assert [score(exact, "q", c, "Paris") for c in ("It is paris.", "Paris!", "Paris is it", "", "**Paris**")] \
        == [1.0, 1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="needs an 'answer'"):
        score(exact, "q", "4", None)
    tagged = load_reward(r"regex:<answer>\d+</answer>")
    assert [score(tagged, "q", c, None) for c in ("<answer>12</answer>\n", "so <answer>12</answer>", "<answer>x</answer>")] \
        == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="not a regular expression"):
        load_reward("regex:(")


def test_a_reward_named_by_module_or_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompt, completion):\n    return len(completion)\n"
        "def has(prompt, completion, answer):\n    return answer in completion\n"
        "def broken(prompt, completion):\n    return 'high'\n"
        "def nothing():\n    return 1.0\n")
    by_file = load_reward(f"{tmp_path / 'my_rewards.py'}:length")
    assert score(by_file, "p", "abc", None) == 3.0
    monkeypatch.syspath_prepend(str(tmp_path))
    assert score(load_reward("my_rewards:has"), "p", "x 4 y", "4") == 1.0  # a bool counts as 0 or 1
    with pytest.raises(ValueError, match="finite number"):
        score(load_reward("my_rewards:broken"), "p", "c", None)
    for spec, message in (("my_rewards:missing", "no function 'missing'"), ("no_such_module_x:f", "cannot import"),
                          (f"{tmp_path / 'absent.py'}:f", "no file"), ("my_rewards:nothing", "must take"),
                          ("exact", "give exact_match")):
        with pytest.raises(ValueError, match=message):
            load_reward(spec)


def test_problem_records_are_rendered_with_the_generation_prompt(tmp_path):
    template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}" \
               "{% if add_generation_prompt %}a:{% endif %}"
    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz 0123456789+?:;")
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "what is 2+2?", "answer": "4"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}], "answer": 2},
        "", {"prompt": "say hi"}])
    problems = load_problems(path, tokenizer, template)
    assert [tokenizer.decode(p.prompt_ids) for p in problems] == ["u:what is 2+2?;a:", "s:be brief;u:1+1?;a:", "u:say hi;a:"]
    assert [p.prompt_text for p in problems] == [tokenizer.decode(p.prompt_ids) for p in problems]
    assert [p.problem.answer for p in problems] == ["4", "2", None]
    bad = [({"answer": "4"}, ":1: missing field 'prompt'"), ({"prompt": "q", "answer": [4]}, ":1: answer must be"),
           ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "assistant turn"),
           ({"prompt": [{"role": "robot", "content": "q"}]}, ":1: prompt: messages\\[0\\].role"), ("[1]", ":1: a record must be a JSON object"),
           ("{", ":1: not JSON")]
    for record, message in bad:
        with pytest.raises(ValueError, match=message):
            read_problems(_write_jsonl(tmp_path / "bad.jsonl", [record]))
    with pytest.raises(ValueError, match="holds no problems"):
        read_problems(_write_jsonl(tmp_path / "empty.jsonl", [""]))


# ----- glasslm finetune --method grpo -----

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
TOKENIZER = CharTokenizer.from_text("abcdefgh xyz ua:;")


@pytest.fixture
def problems(tmp_path):
    generator = torch.Generator().manual_seed(0)
    words = ["".join("abcdefgh"[i] for i in torch.randint(8, (4,), generator=generator).tolist()) for _ in range(64)]
    _write_jsonl(tmp_path / "problems.jsonl", [{"prompt": w, "answer": w[0]} for w in words])
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=TOKENIZER.vocab_size, context_length=48, n_layers=2))
    save_checkpoint(tmp_path / "base", model, TOKENIZER)
    (tmp_path / "t.jinja").write_text(TEMPLATE + "a:")
    (tmp_path / "rewards.py").write_text("def xs(prompt, completion):\n"
                                         "    return completion.count('x') / max(1, len(completion))\n")
    return tmp_path


def _grpo(folder, out, *extra):
    args = ["finetune", "--checkpoint", str(folder / "base"), "--method", "grpo", "--data", str(folder / "problems.jsonl"),
            "--chat-template", str(folder / "t.jinja"), "--out", str(folder / out), "--batch-size", "8",
            "--warmup-steps", "0", "--no-progress", "--device", "cpu", "--threads", "1", *extra]
    assert main(args) == 0
    return [json.loads(line) for line in (folder / out / "metrics.jsonl").read_text().splitlines()]


def test_a_tiny_model_learns_to_raise_its_reward(problems):
    """A random model writes 'x' in about 1 of 17 characters; rewarded for them, it writes more."""
    records = _grpo(problems, "grpo", "--full", "--lr", "3e-3", "--max-steps", "16", "--log-interval", "1",
                    "--reward", f"{problems / 'rewards.py'}:xs", "--max-new-tokens", "4", "--group-size", "4")
    for key in ("reward", "reward_std", "kl", "completion_length", "clip_ratio"):
        assert key in records[0], key
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1 samples from the reference itself
    assert records[0]["reward"] < 0.3
    assert sum(r["reward"] for r in records[-4:]) / 4 > 0.8
    assert records[-1]["kl"] > 0.1  # the policy has moved from its reference
    assert main(["plot", str(problems / "grpo")]) == 0  # the loss row, and below it reward, KL and lengths per step
    png = (problems / "grpo" / "loss.png").read_bytes()
    assert int.from_bytes(png[20:24], "big") > 800  # the image's height: two rows of panels (one row is 440)
    assert [key for key, _ in signals_logged(records)] == ["reward", "kl", "completion_length"]


def test_a_lora_run_with_exact_match_logs_its_rewards_and_resumes(problems):
    records = _grpo(problems, "lora", "--reward", "exact_match", "--max-new-tokens", "3", "--max-steps", "2",
                    "--log-interval", "1")
    assert len(records) == 2
    assert all(0.0 <= r["reward"] <= 1.0 and 1 <= r["completion_length"] <= r["completion_length_max"] == 3
               for r in records)
    assert main(["finetune", "--resume", str(problems / "lora"), "--max-steps", "3", "--no-progress"]) == 0
    saved = resolve_checkpoint(problems / "lora", prefer=("latest",))
    assert json.loads((saved / "meta.json").read_text())["finetune"]["reward"] == "exact_match"


@pytest.mark.parametrize("extra, message", [
    ((), "needs --reward"), (("--reward", "exact_match", "--group-size", "1"), "group-size"),
    (("--reward", "exact_match", "--grpo-epsilon", "0"), "grpo-epsilon"),
    (("--reward", "exact_match", "--lora-bias", "all"), "reference"),
    (("--reward", "nowhere_module:f"), "cannot import"),
    (("--reward", "exact_match", "--data", "unanswered"), "have no 'answer' field"),
    (("--reward", "exact_match", "--max-new-tokens", "46"), "no room for --max-new-tokens 46"),
])
def test_grpo_options_are_checked(problems, extra, message, capsys):
    args = ["finetune", "--checkpoint", str(problems / "base"), "--method", "grpo", "--data",
            str(problems / "problems.jsonl"), "--chat-template", str(problems / "t.jinja"), "--out", str(problems / "bad"),
            "--max-steps", "1", "--no-progress", *extra]
    if "unanswered" in extra:
        _write_jsonl(problems / "unanswered", [{"prompt": "abc", "answer": "a"}, {"prompt": "bcd"}])
        args[args.index("unanswered")] = str(problems / "unanswered")
    try:
        code = main(args)
    except SystemExit as exited:  # argparse's own checks (a minimum)
        code = exited.code
    assert code != 0
    assert message in capsys.readouterr().err


def test_a_short_run_prints_its_rewards_and_a_done_line_and_warns_before_a_long_one(problems, capsys, monkeypatch):
    """Issue 47: a 6-step run logged nothing (its log interval was 10) and printed no `done:` line; a
    run estimated at hours started without a word."""
    import glasslm.cli.finetune as command

    monkeypatch.setattr(command, "WARN_LONGER_THAN_S", 1e-3)  # any run is "long" here
    args = ["finetune", "--checkpoint", str(problems / "base"), "--method", "grpo", "--data",
            str(problems / "problems.jsonl"), "--chat-template", str(problems / "t.jinja"), "--out",
            str(problems / "short"), "--batch-size", "8", "--device", "cpu", "--threads", "1",
            "--reward", "exact_match", "--max-new-tokens", "3", "--max-steps", "6"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in (problems / "short" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # the log interval follows the run's length
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert "after 6 steps" in done and f"reward {records[-1]['reward']:.4f}" in done and "kl " in done
    assert "warning: this run would take" in err and "--max-steps " in err
    assert "reward=" in err and "kl=" in err  # the progress line's metrics

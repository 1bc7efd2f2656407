"""GRPO: the loss on one batch of sampled completions against TRL's GRPOTrainer._compute_loss (same
samples, masks, sampling-policy and reference log-probabilities, advantages, weights), the group
advantages against TRL's normalisation, and the per-token log-probabilities against TRL's."""

from __future__ import annotations

import json

import pytest
import torch

from chat_models import hf_llama, hf_tokenizer
from glasslm.data.problems import load_problems, read_problems
from glasslm.data.sft import IGNORE_INDEX, SFTExample, padded_batch
from glasslm.training.dpo import token_log_probs
from glasslm.tokenizers import CharTokenizer
from glasslm.training.grpo import group_advantages, grpo_loss
from glasslm.training.rewards import load_reward, score


pytestmark = pytest.mark.usefixtures("one_thread")


def _trl_trainer(model: str, tmp_path, beta: float, epsilon: float, group_size: int):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, beta=beta, epsilon=epsilon,
                      num_generations=group_size, per_device_train_batch_size=4, max_completion_length=8,
                      save_strategy="no", bf16=False)
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


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_the_loss_equals_trls_on_the_same_samples(tmp_path, beta):
    from glasslm.hf import load_model

    epsilon = 0.2
    hf_llama(0).save_pretrained(tmp_path / "policy")
    hf_tokenizer().save_pretrained(tmp_path / "policy")
    policy, _ = load_model(tmp_path / "policy")
    trainer = _trl_trainer(str(tmp_path / "policy"), tmp_path, beta, epsilon, group_size=2)  # its reference: the same file
    x, y = _our_batch()
    ours = token_log_probs(policy(x), y)                                                 # (rows, width)
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

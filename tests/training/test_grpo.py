"""GRPO: the loss on one batch of sampled completions against TRL's GRPOTrainer._compute_loss (same
samples, masks, sampling-policy and reference log-probabilities, advantages, weights), the group
advantages against TRL's normalisation, and the per-token log-probabilities against TRL's."""

from __future__ import annotations

import pytest
import torch

from chat_models import hf_tokenizer
from glasslm.data.sft import IGNORE_INDEX, SFTExample, padded_batch
from glasslm.training.dpo import token_log_probs
from glasslm.training.grpo import group_advantages, grpo_loss


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _hf_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(hf_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # log-probabilities far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


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
    _hf_llama(0).save_pretrained(tmp_path / "policy")
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

"""Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath): reinforcement learning from a
verifiable reward, with no value model. For each prompt the policy samples a group of G completions;
each is scored by a plain function (glasslm.evaluation.rewards), and a completion's advantage is how
much better it scored than its group:

    A_i      = (r_i - mean(r_group)) / (std(r_group) + 1e-4)                  (`group_advantages`)
    ρ_i,t    = π(o_i,t | q, o_i,<t) / π_old(o_i,t | q, o_i,<t)                 (`grpo_loss`: ratio)
    L_clip   = -min(ρ A, clip(ρ, 1 - ε, 1 + ε) A)                            (`grpo_loss`: surrogate)
    KL_i,t   = ρ (π_ref / π - log(π_ref / π) - 1)                             (`grpo_loss`: kl, the k3 estimator)
    L        = Σ_i Σ_t (L_clip + β KL) / Σ_i |o_i|                            (`grpo_loss`: loss)

π_old is the policy that sampled the completions: with one update per sample (as here, and TRL's
default) ρ = 1 in value, so the clipping never binds, but not in gradient. The KL term is weighted by
ρ, which makes its gradient the reverse KL's without bias (TRL's `use_bias_correction_kl`). π_ref is
the model training started from (LoRA: the base with its adapters off, as DPO's reference). The loss
is summed over every completion token of the batch and divided by their count (TRL 1.16's default
`loss_type="dapo"`); the std is each group's sample std, Bessel-corrected (`scale_rewards="group"`).
tests/training/test_grpo.py checks the loss against TRL's `GRPOTrainer._compute_loss` on the same
samples. `GRPOObjective` is the training loop's objective (it samples through glasslm's KV-cache
decoding, `sample_completions`); `grpo_setup` builds it for `glasslm finetune --method grpo`.

Example (two groups of two: the better completion of the first group gets advantage +0.707; on the
samples' own policy (ρ = 1) the loss is minus the advantages' mean over the completion tokens):
    >>> import torch
    >>> advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
    >>> [round(a, 3) for a in advantages.tolist()]
    [0.707, -0.707, 0.0, 0.0]
    >>> log_probs = torch.full((4, 3), -1.0)
    >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]).bool()  # lengths 3, 1, 2, 1
    >>> loss, _ = grpo_loss(log_probs, log_probs, None, advantages, mask, epsilon=0.2, beta=0.0)
    >>> round(loss.item(), 4), round(-(3 * 0.7070 - 1 * 0.7070) / 7, 4)
    (-0.202, -0.202)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from glasslm.core.model import TransformerLM
from glasslm.data.problems import EncodedProblem, load_problems
from glasslm.data.sft import IGNORE_INDEX, SFTExample, padded_batch
from glasslm.evaluation.problems import check_answers, prompt_text
from glasslm.evaluation.rewards import Reward, load_reward, score
from glasslm.generation.decoding import decode_steps
from glasslm.generation.sampling import GenerationConfig, with_eos, with_vocab_limit
from glasslm.training.batches import ProblemBatches
from glasslm.training.dpo import reference_model, token_log_probs
from glasslm.training.finetune import FinetuneConfig

ADVANTAGE_EPS = 1e-4  # TRL's: keeps a group whose rewards are all equal at advantage 0


def group_advantages(rewards: Float[Tensor, "rows"], group_size: int) -> Float[Tensor, "rows"]:
    """(reward - its group's mean) / (its group's sample std + 1e-4); rows i*G .. i*G + G - 1 are
    prompt i's group of G completions."""
    if group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards come in groups of at least 2 (got {rewards.shape[0]} rewards in groups of "
                         f"{group_size})")
    groups = rewards.view(-1, group_size)                                               # (prompts, G)
    mean = groups.mean(dim=1, keepdim=True)                                             # (prompts, 1)
    std = groups.std(dim=1, keepdim=True)                                               # (prompts, 1), Bessel
    return ((groups - mean) / (std + ADVANTAGE_EPS)).reshape(-1)


def grpo_loss(policy: Float[Tensor, "rows seq"], old: Float[Tensor, "rows seq"],
              reference: Float[Tensor, "rows seq"] | None, advantages: Float[Tensor, "rows"],
              mask: Bool[Tensor, "rows seq"], epsilon: float, beta: float) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
    """(GRPO loss, statistics) from the per-token log-probabilities of the sampled completion tokens
    under the policy (with gradient), the sampling policy and the reference (None: β = 0, no KL
    term); `mask` marks the completion's tokens (not the prompt, not the padding after its end)."""
    mask = mask.to(policy.dtype)
    ratio = torch.exp(policy - old)                                                     # (rows, seq)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)                              # (rows, seq)
    advantages = advantages[:, None]                                                    # (rows, 1)
    per_token = -torch.min(ratio * advantages, clipped * advantages)                    # (rows, seq)
    stats: dict[str, Tensor] = {}
    tokens = mask.sum().clamp(min=1.0)
    if beta != 0.0:
        if reference is None:
            raise ValueError("a KL term (beta != 0) needs the reference's log-probabilities")
        kl = torch.exp(reference - policy) - (reference - policy) - 1                   # (rows, seq), >= 0
        # weighted by ρ, so its gradient is the reverse KL's without bias (TRL's use_bias_correction_kl)
        kl = kl * ratio
        per_token = per_token + beta * kl
        stats["kl"] = ((kl * mask).sum() / tokens).detach()
    is_clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + epsilon) & (advantages > 0))
    stats["clip_ratio"] = ((is_clipped.to(mask.dtype) * mask).sum() / tokens).detach()
    return (per_token * mask).sum() / tokens, stats


def sample_completions(model: TransformerLM, prompts: Sequence[Sequence[int]], config: GenerationConfig) -> list[list[int]]:
    """One sampled completion of each prompt, from glasslm's batched KV-cache decoding (`decode_steps`),
    each ending with the stop token the model chose (kept: the policy learns when to stop too) or
    after config.max_new_tokens tokens."""
    stops = set(config.stop_tokens)
    completions: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in decode_steps(model, prompts, config):
        for row, token in enumerate(step.tokens.tolist()):
            if not done[row]:
                completions[row].append(token)
                done[row] = token in stops
        if all(done):
            break
    return completions


def completion_log_probs(logits: Float[Tensor, "rows seq vocab"], labels: Int[Tensor, "rows seq"],
                         temperature: float) -> Float[Tensor, "rows seq"]:
    """log p(label) under the distribution the completions were sampled from: softmax(logits / T)."""
    return token_log_probs(logits / temperature if temperature != 1.0 else logits, labels)


def completion_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                    context_length: int) -> tuple[Int[Tensor, "rows seq"], Int[Tensor, "rows seq"]]:
    """(prompt + completion ids, labels on the completion's tokens only), right-padded."""
    examples = [SFTExample([*p, *c], [IGNORE_INDEX] * (len(p) - 1) + [*c, IGNORE_INDEX])
                for p, c in zip(prompts, completions)]
    return padded_batch(examples, context_length)


class GRPOObjective:
    """GRPO as a `glasslm.training.step.Objective`: each batch row names a problem (`ProblemBatches`);
    the policy samples `group_size` completions of each, the reward scores them, and the loss is
    `grpo_loss` on them. `reference` maps ids to the reference's logits (glasslm.training.dpo.reference_model)."""

    def __init__(self, problems: Sequence[EncodedProblem], tokenizer: Any, reward: Reward,
                 reference: Callable[[Tensor], Tensor] | None, generation: GenerationConfig, group_size: int,
                 epsilon: float, beta: float):
        self.problems, self.tokenizer, self.reward, self.reference = list(problems), tokenizer, reward, reference
        self.generation, self.group_size, self.epsilon, self.beta = generation, group_size, epsilon, beta

    def __call__(self, model: nn.Module, x: Int[Tensor, "prompts 1"],
                 y: Int[Tensor, "prompts 1"]) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
        group = [self.problems[i] for i in x[:, 0].tolist() for _ in range(self.group_size)]
        prompts = [p.prompt_ids for p in group]
        completions = self._sample(model, prompts)
        rewards = torch.tensor([score(self.reward, prompt_text(p), self._text(c), p.problem.answer)
                                for p, c in zip(group, completions)])
        ids, labels = completion_rows(prompts, completions, model.config.context_length)  # (rows, seq) each
        ids, labels = ids.to(x.device), labels.to(x.device)
        temperature = self.generation.temperature
        policy = completion_log_probs(model(ids), labels, temperature)                     # (rows, seq)
        reference = None
        if self.beta != 0.0:
            with torch.no_grad():
                reference = completion_log_probs(self.reference(ids), labels, temperature)  # (rows, seq)
        advantages = group_advantages(rewards, self.group_size).to(policy.device)          # (rows,)
        loss, stats = grpo_loss(policy, policy.detach(), reference, advantages, labels != IGNORE_INDEX,
                                self.epsilon, self.beta)
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        sampled = {"reward": rewards.mean(), "reward_std": rewards.view(-1, self.group_size).std(dim=1).mean(),
                   "completion_length": lengths.mean(), "completion_length_max": lengths.max()}
        return loss, stats | {name: value.to(loss.device) for name, value in sampled.items()}

    def _text(self, completion: list[int]) -> str:
        """What the reward sees: the completion's text, without the stop token that ended it."""
        if completion and completion[-1] in self.generation.stop_tokens:
            completion = completion[:-1]
        return self.tokenizer.decode(completion)

    def _sample(self, model: nn.Module, prompts: list[list[int]]) -> list[list[int]]:
        """Completions sampled with dropout off and no gradient; the model's mode is restored."""
        training = model.training
        model.eval()
        try:
            return sample_completions(model, prompts, self.generation)
        finally:
            model.train(training)


def grpo_setup(data: str, model: TransformerLM, tokenizer: Any, template: str,
               config: FinetuneConfig) -> tuple[tuple[ProblemBatches, None], GRPOObjective]:
    """(the problems as batches, no held-out set; the objective) `glasslm finetune --method grpo` trains
    `model` (as `prepare_model` returns it, before training moves it) with. Completions are sampled at
    `config.temperature` (1 by default: the model's own distribution), stopping at its eos ids, as TRL does."""
    if tokenizer is None:
        raise ValueError("the base holds no tokenizer, so the problems cannot be encoded")
    assert config.reward is not None  # FinetuneConfig.check
    reward = load_reward(config.reward)
    problems = load_problems(data, tokenizer, template)
    check_answers(problems, config.reward, reward, data)  # before any sampling, not at the first unanswered draw
    generation = with_vocab_limit(with_eos(GenerationConfig(max_new_tokens=config.max_new_tokens,
                                                                    temperature=config.temperature), model, tokenizer),
                                  model, tokenizer)
    reference = reference_model(model, config.full) if config.grpo_beta != 0.0 else None
    objective = GRPOObjective(problems, tokenizer, reward, reference, generation, config.group_size,
                              config.grpo_epsilon, config.grpo_beta)
    return (ProblemBatches(problems, model.config.context_length, config.max_new_tokens), None), objective

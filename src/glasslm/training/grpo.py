"""Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath): reinforcement learning from a
verifiable reward, with no value model. For each prompt the policy samples a group of G completions;
each is scored by a plain function (glasslm.training.rewards), and a completion's advantage is how
much better it scored than its group:

    A_i      = (r_i - mean(r_group)) / (std(r_group) + 1e-4)                  (`group_advantages`)
    ρ_i,t    = π(o_i,t | q, o_i,<t) / π_old(o_i,t | q, o_i,<t)                 (`grpo_loss`: ratio)
    L_clip   = -min(ρ A, clip(ρ, 1 - ε, 1 + ε) A)                            (`grpo_loss`: surrogate)
    KL_i,t   = ρ (π_ref / π - log(π_ref / π) - 1)                             (`grpo_loss`: kl, the k3 estimator)
    L        = Σ_i Σ_t (L_clip + β KL) / Σ_i |o_i|                            (`grpo_loss`: loss)

π_old is the policy that sampled the completions (with one update per sample, as here and TRL's
default, ρ = 1 in value but not in gradient; the KL term is weighted by ρ, which makes its gradient
the reverse KL's without bias, TRL's `use_bias_correction_kl`), π_ref the model training started from (LoRA: the base
with its adapters off, as DPO's reference). The loss is summed over every completion token of the
batch and divided by their count (TRL 1.16's default `loss_type="dapo"`), the std is the sample std
(Bessel-corrected) of each group (TRL's `scale_rewards="group"`). tests/training/test_grpo.py checks
the loss against TRL's `GRPOTrainer._compute_loss` on the same samples.

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

import torch
from jaxtyping import Bool, Float
from torch import Tensor

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

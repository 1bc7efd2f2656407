"""Direct Preference Optimization (Rafailov et al., 2023): tuning a model towards the preferred of two
completions of the same prompt, with no reward model and no sampling.

With π the model being trained, π_ref the model it started from (frozen), y_w the chosen and y_l the
rejected completion of prompt x, and log π(y|x) the sum of the completion tokens' log-probabilities:

    r(y) = β (log π(y|x) - log π_ref(y|x))          the implicit reward      (`dpo_loss`: rewards)
    L    = -log σ(r(y_w) - r(y_l))                    averaged over pairs      (`dpo_loss`: loss)

β (--dpo-beta) sets how far π may move from π_ref: a small β lets it drift further. The reference
log-probabilities are computed once per batch, without gradients. With LoRA (and QLoRA) the
reference is the model with its adapters switched off, the base it trains on
(`glasslm.transforms.lora.adapters_disabled`, as TRL uses a PEFT model's base when ref_model is None);
a full fine-tune keeps a frozen copy of the starting weights.

This is TRL's `DPOTrainer` with its default loss ("sigmoid"); tests/training/test_dpo.py checks the
loss, rewards and margins against it on the same batch and weights. SimPO (`simpo_loss`) is the
reference-free relative: the mean token log-probability in place of the sum, and a margin γ. ORPO
(`orpo_loss`, Hong et al., 2024) is another: the supervised loss on the chosen answer plus β times
-log σ of the log odds ratio of the two answers' mean token probabilities.

Example (a policy that prefers the chosen completions more than its reference does):
    >>> import torch
    >>> loss, stats = dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -2.5]),
    ...                        torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]), beta=0.5)
    >>> round(loss.item(), 4), stats["rewards/margins"].item(), stats["rewards/accuracies"].item()
    (0.4446, 0.625, 1.0)
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.core.layers import upcast
from glasslm.core.model import TransformerLM
from glasslm.data.sft import IGNORE_INDEX
from glasslm.transforms.lora import adapters_disabled, lora_layers


def token_log_probs(logits: Float[Tensor, "rows seq vocab"],
                    labels: Int[Tensor, "rows seq"]) -> Float[Tensor, "rows seq"]:
    """log p(label) at every position; 0 where the label is IGNORE_INDEX (the prompt, the padding)."""
    rows, seq, vocab = logits.shape
    log_probs = -F.cross_entropy(upcast(logits).reshape(rows * seq, vocab), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="none")  # (rows * seq,)
    return log_probs.view(rows, seq)


def sequence_log_probs(logits: Float[Tensor, "rows seq vocab"],
                       labels: Int[Tensor, "rows seq"]) -> Float[Tensor, "rows"]:
    """log π(completion | prompt) of each row: the sum of log p(label) over its labelled positions
    (labels equal to IGNORE_INDEX, the prompt and the padding, add nothing)."""
    return token_log_probs(logits, labels).sum(dim=-1)


def dpo_loss(policy_chosen: Float[Tensor, "pairs"], policy_rejected: Float[Tensor, "pairs"],
             reference_chosen: Float[Tensor, "pairs"], reference_rejected: Float[Tensor, "pairs"],
             beta: float) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
    """(mean DPO loss, statistics) from each pair's summed completion log-probabilities under the
    policy and the reference. The statistics are TRL's: the mean rewards of the chosen and rejected
    completions, their mean margin and how often the chosen one's reward is the higher."""
    chosen_rewards = beta * (policy_chosen - reference_chosen)                        # (pairs,)
    rejected_rewards = beta * (policy_rejected - reference_rejected)                  # (pairs,)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards)                         # (pairs,)
    return losses.mean(), reward_stats(chosen_rewards, rejected_rewards)


def simpo_loss(policy_chosen_mean: Float[Tensor, "pairs"], policy_rejected_mean: Float[Tensor, "pairs"],
               beta: float, gamma: float) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
    """SimPO (Meng et al., 2024), which needs no reference: with m(y) the mean log-probability of the
    answer's tokens, r(y) = β m(y) and L = -log σ(r(y_w) - r(y_l) - γ), a margin γ the chosen answer's
    reward must clear (TRL's CPOTrainer with loss_type="simpo" and cpo_alpha=0)."""
    chosen_rewards, rejected_rewards = beta * policy_chosen_mean, beta * policy_rejected_mean  # (pairs,) each
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)                 # (pairs,)
    return losses.mean(), reward_stats(chosen_rewards, rejected_rewards)


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation at either end (Mächler, 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(policy_chosen_mean: Float[Tensor, "pairs"], policy_rejected_mean: Float[Tensor, "pairs"],
              chosen_nll: Float[Tensor, ""], beta: float) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
    """ORPO (Hong et al., 2024), which needs no reference: with m(y) the mean log-probability of the
    answer's tokens, odds(y) = e^m / (1 - e^m) and
    L = NLL(y_w) - β mean(log σ(log odds(y_w) - log odds(y_l))), where NLL(y_w) is the chosen answers'
    cross-entropy (TRL's ORPOTrainer, whose β is the paper's λ; its rewards are β m(y))."""
    log_odds = (policy_chosen_mean - policy_rejected_mean) \
        - (log1mexp(policy_chosen_mean) - log1mexp(policy_rejected_mean))                  # (pairs,)
    log_odds_ratio = F.logsigmoid(log_odds)                                                # (pairs,)
    stats = reward_stats(beta * policy_chosen_mean, beta * policy_rejected_mean)
    stats |= {"nll_loss": chosen_nll.detach(), "log_odds_ratio": log_odds_ratio.detach().mean(),
              "log_odds_chosen": log_odds.detach().mean()}
    return chosen_nll - beta * log_odds_ratio.mean(), stats


def reward_stats(chosen_rewards: Float[Tensor, "pairs"], rejected_rewards: Float[Tensor, "pairs"]) -> dict[str, Tensor]:
    """TRL's logged statistics: the mean rewards, their mean margin, how often the chosen one's is higher."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean()}


class PairObjective:
    """What the preference losses share, as a `glasslm.training.step.Objective` for the training loop:
    a batch from `PreferenceBatches` (rows 2i and 2i + 1: pair i's chosen and rejected sides) and a β."""

    def __init__(self, beta: float):
        if beta <= 0:
            raise ValueError(f"--dpo-beta must be positive, got {beta}")
        self.beta = beta

    def __call__(self, model: nn.Module, x: Int[Tensor, "rows seq"],
                 y: Int[Tensor, "rows seq"]) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
        if x.shape[0] % 2:
            raise ValueError(f"a preference batch holds pairs (chosen, rejected) in adjacent rows; "
                             f"got {x.shape[0]} rows")
        return self.pair_loss(model, x, y)

    def pair_loss(self, model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError


# `DPOObjective.watch` warns once the chosen answers' tokens have lost this much log-probability each,
# on average, against the reference: on the demo model, DPO runs whose chat had broken (answers that
# lost the name they were asked about, 8 and 2 of 20 right) had -0.14 and -0.18 nats per token; those
# whose chat still answered 17 and 20 of 20 right, -0.026 and -0.001 (docs/training.md).
CHOSEN_DROP_WARNING = 0.1


class DPOObjective(PairObjective):
    """The DPO loss; `reference` maps a batch of ids to the reference model's logits (see `reference_model`).

    Beside TRL's statistics it logs TRL's `logps/chosen` and `logps/rejected` (the policy's summed answer
    log-probabilities) and `logps/chosen_change_per_token`: how far the chosen answers' tokens have moved
    from the reference, in nats per token. DPO can raise the margin by pushing both answers down, and a
    small model then forgets how to answer at all while margin and accuracy look perfect; `watch` says so."""

    def __init__(self, reference: Callable[[Tensor], Tensor], beta: float):
        super().__init__(beta)
        self.reference = reference
        self.warned = False

    def pair_loss(self, model: nn.Module, x: Int[Tensor, "rows seq"],
                  y: Int[Tensor, "rows seq"]) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
        log_probs = sequence_log_probs(model(x), y)                                   # (2 * pairs,)
        with torch.no_grad():
            reference_log_probs = sequence_log_probs(self.reference(x), y)            # (2 * pairs,)
        loss, stats = dpo_loss(log_probs[0::2], log_probs[1::2], reference_log_probs[0::2],
                               reference_log_probs[1::2], self.beta)
        chosen_tokens = (y[0::2] != IGNORE_INDEX).sum(dim=-1).clamp(min=1)            # (pairs,)
        change = (log_probs[0::2].detach() - reference_log_probs[0::2]) / chosen_tokens  # (pairs,)
        return loss, stats | {"logps/chosen": log_probs[0::2].detach().mean(),
                              "logps/rejected": log_probs[1::2].detach().mean(),
                              "logps/chosen_change_per_token": change.mean()}

    def watch(self, record: dict) -> str | None:
        """A warning, once, when a metrics record shows the chosen answers collapsing (the training loop
        calls this with each record)."""
        change = record.get("logps/chosen_change_per_token")
        if self.warned or change is None or change > -CHOSEN_DROP_WARNING:
            return None
        self.warned = True
        return (f"warning: step {record['step']}: the chosen answers' tokens are {-change:.2f} nats less likely each "
                f"than under the reference (rewards/chosen {record['rewards/chosen']:.3f}): DPO is pushing both "
                "answers down, which wrecks a small model's answers even while margin and accuracy look perfect; "
                "try glasslm chat on a checkpoint, and lower --lr or --epochs, or raise --dpo-beta")


class SimPOObjective(PairObjective):
    """The SimPO loss: no reference model, the mean log-probability per answer token in place of the sum."""

    def __init__(self, beta: float, gamma: float):
        super().__init__(beta)
        self.gamma = gamma

    def pair_loss(self, model: nn.Module, x: Int[Tensor, "rows seq"],
                  y: Int[Tensor, "rows seq"]) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
        answer_tokens = (y != IGNORE_INDEX).sum(dim=-1).clamp(min=1)                  # (2 * pairs,)
        mean_log_probs = sequence_log_probs(model(x), y) / answer_tokens              # (2 * pairs,)
        return simpo_loss(mean_log_probs[0::2], mean_log_probs[1::2], self.beta, self.gamma)


class ORPOObjective(PairObjective):
    """The ORPO loss: no reference model; the chosen answers' cross-entropy plus the odds-ratio term."""

    def pair_loss(self, model: nn.Module, x: Int[Tensor, "rows seq"],
                  y: Int[Tensor, "rows seq"]) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
        per_token = token_log_probs(model(x), y)                                      # (2 * pairs, seq)
        answer_tokens = (y != IGNORE_INDEX).sum(dim=-1)                               # (2 * pairs,)
        mean_log_probs = per_token.sum(dim=-1) / answer_tokens.clamp(min=1)           # (2 * pairs,)
        chosen_nll = -per_token[0::2].sum() / answer_tokens[0::2].sum().clamp(min=1)  # every chosen token alike
        return orpo_loss(mean_log_probs[0::2], mean_log_probs[1::2], chosen_nll, self.beta)


def preference_objective(method: str, model: TransformerLM, full: bool, beta: float,
                         simpo_gamma: float) -> PairObjective:
    """The objective `glasslm finetune --method dpo|simpo|orpo` trains `model` (as `prepare_model` returns it) on."""
    if method == "simpo":
        return SimPOObjective(beta, simpo_gamma)
    if method == "orpo":
        return ORPOObjective(beta)
    return DPOObjective(reference_model(model, full), beta)


def reference_model(model: TransformerLM, full: bool) -> Callable[[Tensor], Tensor]:
    """The reference's logits as a function of the ids, for `model` as `prepare_model` returns it
    (call it before training moves the weights): a LoRA model with its adapters switched off, or for
    a full fine-tune a frozen copy of the weights it has now."""
    if full:
        frozen = copy.deepcopy(model).eval().requires_grad_(False)
        return frozen
    if not lora_layers(model):
        raise ValueError("a LoRA reference needs the model's adapters (prepare_model adds them)")

    def base_logits(ids: Tensor) -> Tensor:
        with adapters_disabled(model):
            return model(ids)

    return base_logits


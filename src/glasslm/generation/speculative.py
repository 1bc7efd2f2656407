"""Speculative decoding (greedy): a small draft model guesses, the target model checks in one pass.

Decoding is bound by reading the target's weights once per step. A draft model sharing the
vocabulary proposes `lookahead` tokens one at a time (cheap: it is small); the target then scores
the last accepted token plus all proposals in a single forward pass, which reads its weights once
for k+1 positions. Proposals are accepted while they equal the target's own greedy choice; at the
first disagreement the target's choice is taken instead. So every round yields 1 to k+1 tokens,
and the output is exactly the target's greedy output — the draft only changes the speed.

Both KV caches are rolled back by moving their cursor (`cache.length`): slots past it are simply
overwritten by the next round.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.generation import generate_tokens
    >>> from glasslm.core.model import TransformerLM
    >>> _ = torch.manual_seed(0)
    >>> target = TransformerLM(get_preset("llama-tiny")).eval()
    >>> draft = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
    >>> stats = SpeculativeStats()
    >>> fast = list(speculative_tokens(target, draft, [1, 2, 3], max_new_tokens=12, stats=stats))
    >>> fast == list(generate_tokens(target, [1, 2, 3], max_new_tokens=12, temperature=0.0))
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from glasslm.core.model import TransformerLM


@dataclass
class SpeculativeStats:
    """Counts from one run: how many proposals the target accepted, and in how many target passes."""

    proposed: int = 0
    accepted: int = 0
    target_passes: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.tokens / self.target_passes if self.target_passes else 0.0


def _cache_slots(target: TransformerLM, draft: TransformerLM, prompt: Sequence[int], max_new_tokens: int,
                 lookahead: int) -> int:
    """The KV-cache slots a run needs, after checking the two models and the request fit together."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size}); speculative decoding needs the same tokenizer")
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1, got {lookahead}")
    if not prompt:
        raise ValueError("the prompt is empty")
    total = len(prompt) + max_new_tokens + lookahead + 1
    for name, model in (("target", target), ("draft", draft)):
        if total > model.config.context_length and model.config.positional != "none":
            fits = model.config.context_length - len(prompt) - lookahead - 1
            raise ValueError(f"prompt + max_new_tokens + lookahead + 1 ({total} tokens) exceeds the {name}'s context "
                             f"length {model.config.context_length}; "
                             + (f"at most {fits} new tokens fit after this prompt" if fits > 0 else
                                "the prompt leaves no room: shorten it (speculative decoding does not slide "
                                "the context window)"))
    return total


@torch.inference_mode()
def speculative_tokens(
    target: TransformerLM, draft: TransformerLM, prompt: Sequence[int], max_new_tokens: int,
    lookahead: int = 4, stop_tokens: Sequence[int] = (), stats: SpeculativeStats | None = None,
    vocab_limit: int | None = None,
) -> Iterator[int]:
    """Yield the target's greedy continuation of `prompt`, computed with the draft's help.

    Only ids below `vocab_limit` are picked (`sampling.with_vocab_limit`: past it lie a padded
    embedding table's rows), by the draft and the target alike.
    """
    total = _cache_slots(target, draft, prompt, max_new_tokens, lookahead)
    stats = stats if stats is not None else SpeculativeStats()
    device = target.embed.device
    target_cache = target.new_kv_cache(1, total, device=device)
    draft_cache = draft.new_kv_cache(1, total, device=device)

    def run(model: TransformerLM, cache, ids: Sequence[int], last_only: bool) -> torch.Tensor:
        tokens = torch.tensor([list(ids)], device=device)  # (1, len(ids))
        logits = model(tokens, kv_cache=cache, last_logits_only=last_only)[0].float()  # (seq or 1, vocab)
        return logits[:, :vocab_limit]  # (seq or 1, vocab_limit): no padding row is ever the argmax

    # Invariant: the target's cache holds every token but `last`; the draft's cache lacks `draft_pending`.
    if len(prompt) > 1:
        run(target, target_cache, prompt[:-1], True)
        run(draft, draft_cache, prompt[:-1], True)
    last, draft_pending = prompt[-1], [prompt[-1]]
    produced = 0
    while produced < max_new_tokens:
        k = min(lookahead, max_new_tokens - produced)
        proposals: list[int] = []
        feed = draft_pending
        for _ in range(k):
            proposals.append(int(run(draft, draft_cache, feed, True)[-1].argmax()))
            feed = proposals[-1:]
        # One target pass over [last, p1 .. pk]: row i is its choice after last + p1..pi.
        start = target_cache.length
        choices = run(target, target_cache, [last, *proposals], False).argmax(-1).tolist()  # (k+1,)
        accepted = 0
        while accepted < k and proposals[accepted] == choices[accepted]:
            accepted += 1
        new = proposals[:accepted] + [choices[accepted]]
        target_cache.length = start + 1 + accepted  # keep last and the accepted proposals
        # The draft wrote last (and any older pending tokens) plus p1..p(k-1); keep what was accepted.
        draft_written = draft_cache.length
        keep = draft_written - (k - 1) + accepted
        if accepted == k:  # pk was never fed to the draft: it is pending with the new last token
            draft_cache.length, draft_pending = draft_written, [proposals[-1], new[-1]]
        else:
            draft_cache.length, draft_pending = keep, [new[-1]]
        stats.proposed += k
        stats.accepted += accepted
        stats.target_passes += 1
        for token in new[:max_new_tokens - produced]:
            if token in stop_tokens:  # like generate_tokens: the stop token is not part of the output
                return
            produced += 1
            stats.tokens += 1
            yield token
        last = new[-1]

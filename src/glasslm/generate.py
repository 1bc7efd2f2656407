"""Autoregressive sampling with a KV cache: prefill the prompt once, then one token per step.

Example:
    >>> import torch
    >>> from glasslm.config import get_preset
    >>> from glasslm.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> out = list(generate_tokens(model, [1, 2, 3], max_new_tokens=4, temperature=0.0))
    >>> len(out)
    4
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from .model import TransformerLM


def filter_logits(
    logits: Float[Tensor, "batch vocab"], top_k: int | None = None, top_p: float | None = None
) -> Float[Tensor, "batch vocab"]:
    """Set to -inf every logit outside the top k, and outside the smallest set with mass >= top_p."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (batch, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass strictly before it is below top_p (so the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: Float[Tensor, "batch vocab"], temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, generator: torch.Generator | None = None,
) -> Tensor:
    """Pick one token id per row: argmax when temperature == 0, else sample the filtered softmax."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_tokens(
    model: TransformerLM, prompt: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
    stop_tokens: Sequence[int] = (),
) -> Iterator[int]:
    """Yield new token ids one at a time (for streaming).

    When the sequence outgrows the context, the window slides: the cache is refilled with the last
    context_length - 1 tokens and generation continues from there.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt must contain at least one token")
    device = model.embed.weight.device
    context = model.config.context_length
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    tokens = list(prompt)[-context:]
    cache = model.new_kv_cache(batch=1)
    logits = model(torch.tensor([tokens], device=device), kv_cache=cache)[:, -1]
    for _ in range(max_new_tokens):
        next_id = int(sample_next(logits, temperature, top_k, top_p, generator))
        yield next_id
        if next_id in stop_tokens:
            return
        tokens.append(next_id)
        if cache.length >= context:  # window full: keep the most recent context - 1 tokens
            tokens = tokens[-(context - 1):]
            cache.reset()
            logits = model(torch.tensor([tokens], device=device), kv_cache=cache)[:, -1]
        else:
            logits = model(torch.tensor([[next_id]], device=device), kv_cache=cache)[:, -1]

"""Direct logit attribution and head-detection scores.

* `head_logit_attribution` / `neuron_logit_attribution`: how much each head (each MLP neuron) adds
  directly to a token's logit, through the final norm's cached scale (TransformerLens's
  `cache.logit_attrs(cache.stack_head_results(...))`).
* `previous_token_score`, `duplicate_token_score`, `induction_score`: per (layer, head), the mean
  attention paid to the position that head type attends to (the previous token; the earlier
  copy of the same token; the token after that earlier copy), averaged over the queries that have
  such a position (`previous_token_targets`, `duplicate_token_targets`, `induction_targets` say which).

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> torch.manual_seed(0) and None
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", n_layers=2)).eval()
    >>> tokens = repeated_random_tokens(model.config.vocab_size, half=8, batch=2)  # (2, 16)
    >>> induction_score(model, tokens).shape  # (layers, heads)
    torch.Size([2, 4])
    >>> head_logit_attribution(model, tokens[:1], token=3).shape  # (layers * heads, seq)
    torch.Size([8, 16])
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from glasslm.interp.hooks import run_with_cache


def repeated_random_tokens(vocab_size: int, half: int, batch: int, generator: torch.Generator | None = None,
                           ) -> Int[Tensor, "batch seq"]:
    """Random token sequences of length `half`, each followed by itself: (batch, 2 * half)."""
    first = torch.randint(0, vocab_size, (batch, half), generator=generator)
    return torch.cat([first, first], dim=1)


def _norm_scale_names(model: nn.Module) -> list[str]:
    """The divisors a direct attribution reads: the final norm's, and each post-norm's (Gemma 3)."""
    post = [f"blocks.{i}.{norm}.hook_scale" for i, block in enumerate(model.blocks) for norm in ("ln1_post", "ln2_post")
            if getattr(block, norm, None) is not None]
    return (["ln_final.hook_scale"] if model.ln_final is not None else []) + post


@torch.no_grad()
def head_logit_attribution(model: nn.Module, tokens: Int[Tensor, "1 seq"], token: int | Tensor,
                           incorrect_token: int | Tensor | None = None) -> Float[Tensor, "components seq"]:
    """Each head's direct contribution to the logit of `token` (minus `incorrect_token`'s) at every
    position, one batch row: (layers * heads, seq), rows labelled L{l}H{h} in order."""
    names = [f"blocks.{i}.attn.hook_z" for i in range(len(model.blocks))] + _norm_scale_names(model)
    _, cache = run_with_cache(model, tokens, names_filter=names)
    stack = cache.stack_head_results(layer=-1)  # (components, batch, seq, d_model)
    return cache.logit_attrs(stack, token, incorrect_token)[:, 0]


@torch.no_grad()
def neuron_logit_attribution(model: nn.Module, tokens: Int[Tensor, "1 seq"], token: int | Tensor,
                             layer: int) -> Float[Tensor, "d_mlp seq"]:
    """Each neuron of MLP `layer`: its activation times W_out[n] · W_U[:, token], after the final norm's scale."""
    names = [f"blocks.{layer}.mlp.hook_post"] + _norm_scale_names(model)
    _, cache = run_with_cache(model, tokens, names_filter=names)
    neurons = cache.neuron_results(layer).movedim(-2, 0)  # (d_mlp, batch, seq, d_model)
    return cache.logit_attrs(neurons, token)[:, 0]


def _mean_attention(model: nn.Module, tokens: Tensor, target: Bool[Tensor, "batch query key"]) -> Tensor:
    """(layers, heads): the attention each head pays to `target` keys, averaged over queries that have one."""
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(len(model.blocks))]
    with torch.no_grad():
        _, cache = run_with_cache(model, tokens, names_filter=names)
    has_target = target.any(dim=-1)  # (batch, query)
    scores = []
    for name in names:
        paid = (cache[name] * target[:, None].to(cache[name].dtype)).sum(dim=-1)  # (batch, heads, query)
        scores.append((paid * has_target[:, None]).sum(dim=(0, 2)) / has_target.sum().clamp_min(1))
    return torch.stack(scores)


def previous_token_targets(tokens: Int[Tensor, "batch seq"]) -> Bool[Tensor, "batch query key"]:
    """Where a previous-token head attends: key = query - 1."""
    seq = tokens.shape[1]
    target = torch.eye(seq, dtype=torch.bool, device=tokens.device).roll(-1, dims=1).tril(-1)
    return target.expand(tokens.shape[0], seq, seq)


def duplicate_token_targets(tokens: Int[Tensor, "batch seq"]) -> Bool[Tensor, "batch query key"]:
    """Where a duplicate-token head attends: earlier positions holding the query's token."""
    same = tokens[:, :, None] == tokens[:, None, :]  # (batch, query, key)
    return same.tril(-1)


def induction_targets(tokens: Int[Tensor, "batch seq"]) -> Bool[Tensor, "batch query key"]:
    """Where an induction head attends: the token *after* an earlier copy of the query's token."""
    same = tokens[:, :, None] == tokens[:, None, :]  # (batch, query, key)
    after_copy = torch.zeros_like(same)
    after_copy[:, :, 1:] = same[:, :, :-1]  # key k is induction's target if token k-1 equals the query's
    return after_copy.tril(-1)


def previous_token_score(model: nn.Module, tokens: Int[Tensor, "batch seq"]) -> Float[Tensor, "layers heads"]:
    """Mean attention from each position to the one before it."""
    return _mean_attention(model, tokens, previous_token_targets(tokens))


def duplicate_token_score(model: nn.Module, tokens: Int[Tensor, "batch seq"]) -> Float[Tensor, "layers heads"]:
    """Mean attention from each position to earlier positions holding the same token."""
    return _mean_attention(model, tokens, duplicate_token_targets(tokens))


def induction_score(model: nn.Module, tokens: Int[Tensor, "batch seq"]) -> Float[Tensor, "layers heads"]:
    """Mean attention from each position to the token *after* an earlier copy of the current token."""
    return _mean_attention(model, tokens, induction_targets(tokens))

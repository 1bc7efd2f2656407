"""The numbers behind the explorer page, as plain JSON-able dicts: next-token tables, per-token
loss, attention patterns and the logit lens for one short text.

Each function takes token ids (a list, at most the model's context length) and returns lists and
floats, so the server only has to encode the request and send the result. The work is done by
glasslm's own tools: `inspection.attention_pattern` and `inspection.logit_lens_top` (both on
`hooks.run_with_cache`) and `generate.filter_logits`, so the page shows exactly what the library
computes.

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc")
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=3, n_layers=2)).eval()
    >>> table = next_token(model, tok, tok.encode("abca"), temperature=0.0, k=3)
    >>> [round(sum(row["prob"] for row in table["top"]), 4), sum(row["adjusted"] for row in table["top"])]
    [1.0, 1.0]
    >>> len(logit_lens(model, tok, tok.encode("ab"))["layers"])  # one row per layer
    2
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from glasslm.evaluation.perplexity import sliding_windows
from glasslm.generation import filter_logits
from glasslm.interp.inspection import attention_pattern, logit_lens_top
from glasslm.core.model import TransformerLM


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's own text (a byte-level piece of a character decodes to U+FFFD)."""
    return [tokenizer.decode([int(i)]) for i in ids]


def _tensor(model: TransformerLM, ids: Sequence[int], limit: int | None = None) -> Tensor:
    if not ids:
        raise ValueError("the text encodes to no tokens")
    if limit is None and len(ids) > model.config.context_length:
        raise ValueError(f"{len(ids)} tokens is more than the context length {model.config.context_length}")
    return torch.tensor([list(ids)], dtype=torch.long, device=model.embed.weight.device)


def adjusted_probs(
    logits: Float[Tensor, "vocab"], temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, min_p: float | None = None,
) -> Float[Tensor, "vocab"]:
    """The distribution a token is drawn from under these controls (as `generate.sample_next` draws).

    Temperature 0 is greedy: all the mass on the argmax.

    >>> adjusted_probs(torch.tensor([0.0, 1.0, 0.0]), temperature=0.0)
    tensor([0., 1., 0.])
    """
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    filtered = filter_logits(logits[None] / temperature, top_k, top_p, min_p)[0]
    return torch.softmax(filtered, dim=-1)


@torch.no_grad()
def next_token(
    model: TransformerLM, tokenizer: Any, ids: Sequence[int], temperature: float = 1.0,
    top_k: int | None = None, top_p: float | None = None, min_p: float | None = None, k: int = 10,
) -> dict[str, Any]:
    """The k most likely next tokens after `ids`: the model's own probability (`prob`) and the
    probability under the sampling controls (`adjusted`), sorted by `prob`."""
    logits = model(_tensor(model, ids), last_logits_only=True)[0, -1].float()
    probs = torch.softmax(logits, dim=-1)
    adjusted = adjusted_probs(logits, temperature, top_k, top_p, min_p)
    top = probs.topk(min(k, probs.shape[-1]))
    entropy = float(-(probs * probs.clamp_min(1e-30).log()).sum())
    return {
        "tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "entropy": entropy,
        "kept": int((adjusted > 0).sum()),  # how many tokens the controls leave in play
        "top": [{"id": int(i), "text": tokenizer.decode([int(i)]), "prob": float(p), "adjusted": float(adjusted[i])}
                for p, i in zip(top.values, top.indices)],
    }


@torch.no_grad()
def token_loss(model: TransformerLM, tokenizer: Any, ids: Sequence[int]) -> dict[str, Any]:
    """-log p(token | the tokens before it) for every token after the first (the first has none).

    A text longer than the context is scored in windows that overlap by half a context
    (`evaluate.sliding_windows`), so every token keeps at least half a context of history.
    """
    tokens = _tensor(model, ids, limit=len(ids))[0]
    context = model.config.context_length
    losses = torch.empty(len(ids) - 1)
    for start, end, first in sliding_windows(len(ids), context, max(1, context // 2)):
        log_probs = torch.log_softmax(model(tokens[None, start:end])[0].float(), dim=-1)  # (end - start, vocab)
        targets = tokens[first:end + 1]
        rows = log_probs[first - start - 1:end - start]  # the positions that predict those targets
        losses[first - 1:end] = -rows.gather(-1, targets[:, None])[:, 0].cpu()
    loss_list: list[float | None] = [None, *map(float, losses)]
    mean = float(losses.mean()) if len(losses) else math.nan
    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "loss": loss_list,
            "mean_loss": None if math.isnan(mean) else mean}


def attention(model: TransformerLM, tokenizer: Any, ids: Sequence[int], layer: int,
              head: int | None = None) -> dict[str, Any]:
    """Attention probabilities of `layer` (rows: queries, columns: keys), for one head or all."""
    patterns = attention_pattern(model, _tensor(model, ids), layer).cpu()  # (heads, seq, seq)
    n_heads = patterns.shape[0]
    if head is not None and not 0 <= head < n_heads:
        raise ValueError(f"head {head} does not exist; layer {layer} has heads 0..{n_heads - 1}")
    chosen = patterns if head is None else patterns[head:head + 1]
    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "layer": layer,
            "head": head, "n_heads": n_heads, "patterns": chosen.tolist()}


def logit_lens(model: TransformerLM, tokenizer: Any, ids: Sequence[int]) -> dict[str, Any]:
    """For each layer and position, the top next token read from that layer's residual stream."""
    top_ids, top_probs = logit_lens_top(model, _tensor(model, ids))  # (layers, seq) each
    layers = [[{"id": int(i), "text": tokenizer.decode([int(i)]), "prob": float(p)}
               for i, p in zip(row_ids, row_probs)] for row_ids, row_probs in zip(top_ids, top_probs)]
    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "layers": layers}

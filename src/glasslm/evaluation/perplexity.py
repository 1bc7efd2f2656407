"""How well a model predicts a text: mean loss, perplexity and bits per byte, scored with a
sliding window so every token is predicted once, with as much left context as the stride allows.

Windows hold context_length inputs and start every `stride` tokens. Each window scores only the
targets no earlier window scored: the first window scores all of its targets, later ones their last
`stride`, each of which then sees at least context_length - stride earlier tokens. stride ==
context_length is plain chunking (fast, little context at the start of each chunk); a smaller
stride costs context_length / stride times more compute for more context per token. A text no
longer than context_length + 1 tokens is a single forward pass, whatever the stride.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abcd")
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1))
    >>> with torch.no_grad():
    ...     _ = model.ln_final.weight.zero_()  # every logit 0: a uniform guess over 4 tokens
    >>> round(evaluate_text(model, tok, "abcdabcd")["perplexity"], 6)
    4.0
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from glasslm.core.model import TransformerLM
from glasslm.progress import progress_bar


def sliding_windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) per window: inputs tokens[start:end] predict tokens[start+1:end+1],
    of which targets with index >= first_scored are scored. Together they score 1..n_tokens-1 once.

    >>> sliding_windows(10, context=4, stride=2)
    [(0, 4, 1), (2, 6, 5), (4, 8, 7), (6, 9, 9)]
    """
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in [1, context_length={context}], got {stride}")
    windows = []
    scored_until = 1  # the first token has no context, so it is never a target
    start = 0
    while scored_until < n_tokens:
        end = min(start + context, n_tokens - 1)  # the last input predicts tokens[end]
        windows.append((start, end, scored_until))
        scored_until = end + 1
        start += stride
    return windows


@torch.inference_mode()
def evaluate_tokens(
    model: TransformerLM, tokens: Sequence[int] | Int[Tensor, "n"], stride: int | None = None,
    batch_size: int = 8, progress: bool = False,
) -> dict[str, float]:
    """Summed and mean negative log-likelihood (nats) of tokens[1:] given what precedes each.

    Returns dict(loss, nll, tokens): `loss` the mean over the `tokens` targets, `nll` their sum.
    `progress` shows a tqdm bar on stderr (plain lines when it is not a terminal), counted in scored tokens.
    """
    model.eval()
    device = model.embed.device
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    if len(tokens) < 2:
        raise ValueError("need at least 2 tokens: the first is only context")
    context = model.config.context_length
    windows = sliding_windows(len(tokens), context, stride or context)
    total_nll = torch.zeros((), dtype=torch.float64)
    n_scored = 0
    bar = progress_bar(total=len(tokens) - 1, unit="tok", unit_scale=True, desc="eval", disable=not progress,
                       file=sys.stderr)
    # Full-length windows are stacked into batches; a shorter final window runs on its own.
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        by_length: dict[int, list[tuple[int, int, int]]] = {}
        for w in group:
            by_length.setdefault(w[1] - w[0], []).append(w)
        for length, same in by_length.items():
            inputs = torch.stack([tokens[s:e] for s, e, _ in same]).to(device)  # (batch, length)
            targets = torch.stack([tokens[s + 1:e + 1] for s, e, _ in same]).to(device)
            # Targets scored by an earlier window are ignored (-100 is cross_entropy's ignore index).
            for row, (s, _, first) in enumerate(same):
                targets[row, :first - s - 1] = -100
            logits = model(inputs).float()
            total_nll += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                         reduction="sum").double().cpu()
            scored = int((targets != -100).sum())
            n_scored += scored
            bar.update(scored)
    bar.close()
    assert n_scored == len(tokens) - 1, "windows must score every target exactly once"
    nll = float(total_nll)
    return {"loss": nll / n_scored, "nll": nll, "tokens": n_scored}


def evaluate_text(
    model: TransformerLM, tokenizer: Any, text: str | None, stride: int | None = None, batch_size: int = 8,
    max_tokens: int | None = None, progress: bool = False, ids: Sequence[int] | None = None,
) -> dict[str, float]:
    """Loss (nats per token), perplexity, bits per byte over `text`, scored with a sliding window.

    Bits per byte divides the total information by the UTF-8 bytes of the scored text (everything
    but the first token), so models with different tokenizers can be compared. `max_tokens` scores
    only the first that many tokens; `ids` (already tokenized text, e.g. a prepared dataset's
    val.bin) replaces `text`. Returns dict(loss, perplexity, bits_per_byte, tokens, bytes).
    """
    if ids is None:
        if text is None:
            raise ValueError("evaluate_text needs text or ids")
        ids = tokenizer.encode(text)
    truncated = max_tokens is not None and len(ids) > max_tokens + 1
    ids = [int(i) for i in (ids[:max_tokens + 1] if truncated else ids)]
    if text is None or truncated:
        text = tokenizer.decode(ids)  # the text actually scored, for its byte count
    result = evaluate_tokens(model, ids, stride, batch_size, progress)
    n_bytes = len(text.encode("utf-8")) - len(tokenizer.decode(ids[:1]).encode("utf-8"))
    return {
        "loss": result["loss"],
        "perplexity": math.exp(result["loss"]),
        "bits_per_byte": result["nll"] / math.log(2) / max(n_bytes, 1),
        "tokens": result["tokens"],
        "bytes": n_bytes,
    }

"""Pictures of what a model does: attention patterns and the logit lens.

The numbers come from `glasslm.interp.hooks`; the drawing uses matplotlib (a core dependency).
Figures are drawn with matplotlib's object API onto an Agg canvas, so no display is needed and
no global pyplot state is touched.

(Named `inspection` rather than `inspect` so it can never shadow the standard library module.)

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> attention_pattern(model, torch.tensor([[5, 6, 7]]), layer=0).shape  # (heads, query, key)
    torch.Size([8, 3, 3])
    >>> top_ids, top_probs = logit_lens_top(model, torch.tensor([[5, 6, 7]]))
    >>> top_ids.shape  # (layers, positions)
    torch.Size([4, 3])
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from glasslm.interp.hooks import logit_lens, run_with_cache
from glasslm.core.model import TransformerLM

TITLE_POINTS = 11
LOGIT_LENS_TITLE = "logit lens: top next token decoded from each layer's residual stream"


@torch.no_grad()
def attention_pattern(
    model: TransformerLM, tokens: Int[Tensor, "1 seq"], layer: int
) -> Float[Tensor, "heads seq seq"]:
    """The attention probabilities of every head in `layer` for one sequence (rows: queries)."""
    if not 0 <= layer < len(model.blocks):
        raise ValueError(f"layer {layer} does not exist; the model has layers 0..{len(model.blocks) - 1}")
    name = f"blocks.{layer}.attn.hook_pattern"
    _, cache = run_with_cache(model, tokens, names_filter=[name])
    return cache[name][0].float()


@torch.no_grad()
def logit_lens_top(
    model: TransformerLM, tokens: Int[Tensor, "1 seq"]
) -> tuple[Int[Tensor, "layers seq"], Float[Tensor, "layers seq"]]:
    """The most likely next token, and its probability, read from each block's residual stream."""
    log_probs = logit_lens(model, tokens)[:, 0]  # (layers, seq, vocab)
    top_log_probs, top_ids = log_probs.max(dim=-1)
    return top_ids, top_log_probs.exp()


def token_label(text: str) -> str:
    """A token's text made visible on a plot axis: spaces and newlines drawn as symbols."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥") or "∅"


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("drawing needs matplotlib: pip install matplotlib") from None
    return Figure(figsize=(width, height), dpi=150, layout="constrained")


def plot_attention(
    pattern: Float[Tensor, "seq seq"], labels: Sequence[str], out: str | os.PathLike, title: str = "",
) -> Path:
    """Draw one head's attention pattern as a heat map with the tokens on both axes; save as PNG."""
    seq = pattern.shape[0]
    side = max(4.0, 0.2 * seq + 1.5)  # ~0.2 inch per token keeps 8pt labels apart
    fig = _figure(side + 1.0, side)
    ax = fig.add_subplot()
    # Future keys are masked out by construction: draw them blank rather than as zeros.
    future = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)
    shown = pattern.float().masked_fill(future, float("nan")).numpy()
    image = ax.imshow(shown, cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_facecolor("#eeeeee")
    shown_labels = [token_label(t) for t in labels]
    ax.set_xticks(range(seq), shown_labels, rotation=90, fontsize=8)
    ax.set_yticks(range(seq), shown_labels, fontsize=8)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(_fitted_title(title, side + 1.0), fontsize=TITLE_POINTS)
    fig.colorbar(image, ax=ax, label="attention probability", shrink=0.8)
    path = Path(out)
    fig.savefig(path)
    return path


def plot_logit_lens(
    top_tokens: Sequence[Sequence[str]], top_probs: Float[Tensor, "layers seq"], labels: Sequence[str],
    out: str | os.PathLike, title: str = "",
) -> Path:
    """Draw the logit lens as a grid (`logit_lens_figure`) and save it as PNG."""
    path = Path(out)
    logit_lens_figure(top_tokens, top_probs, labels, title).savefig(path)
    return path


def logit_lens_figure(
    top_tokens: Sequence[Sequence[str]], top_probs: Float[Tensor, "layers seq"], labels: Sequence[str],
    title: str = "",
) -> Any:
    """The logit lens as a matplotlib Figure: one row per layer, one column per input position.

    Each cell shows the top predicted next token after that layer, coloured by its probability.
    """
    n_layers, seq = top_probs.shape
    width = max(5.0, 0.32 * seq + 2.0)
    fig = _figure(width, max(3.0, 0.4 * n_layers + 1.6))
    ax = fig.add_subplot()
    probs = top_probs.float().numpy()
    image = ax.imshow(probs, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    for layer in range(n_layers):
        for pos in range(seq):
            # Light text on dark cells, dark text on light ones.
            colour = "white" if probs[layer, pos] < 0.6 else "black"
            ax.text(pos, layer, token_label(top_tokens[layer][pos]), ha="center", va="center",
                    fontsize=8, color=colour)
    ax.set_xticks(range(seq), [token_label(t) for t in labels], fontsize=8)
    ax.set_yticks(range(n_layers), [f"layer {i}" for i in range(n_layers)], fontsize=8)
    ax.set_xlabel("input token (the cell predicts the token after it)")
    ax.set_title(_fitted_title(title, width), fontsize=TITLE_POINTS)
    fig.colorbar(image, ax=ax, label="top-token probability", fraction=0.025, pad=0.01)
    return fig


def _fitted_title(title: str, width_inches: float) -> str:
    """`title` broken into lines that fit `width_inches`: a title is one line that constrained layout
    never wraps, so a long one over a narrow figure (a short prompt's) was cut at both edges."""
    # An average glyph is about 0.55 em wide in DejaVu Sans; 0.7 em per character leaves a margin
    # for wide letters and for the axes' share of the width.
    characters = max(10, int(width_inches * 72 / (0.7 * TITLE_POINTS)))
    return textwrap.fill(title, characters)


def encode_prompt(tokenizer: Any, prompt: str, context_length: int) -> tuple[Tensor, list[str]]:
    """Token ids (1, seq) of the prompt's last `context_length` tokens, and each token's text."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so the prompt cannot be encoded")
    ids = tokenizer.encode(prompt)[-context_length:]
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return torch.tensor([ids]), [tokenizer.decode([i]) for i in ids]


def draw_attention(model: TransformerLM, tokenizer: Any, prompt: str, layer: int, head: int,
                   out: str | os.PathLike) -> Path:
    """Encode `prompt`, take `layer`'s pattern for `head`, and save the picture to `out`."""
    tokens, labels = encode_prompt(tokenizer, prompt, model.config.context_length)
    patterns = attention_pattern(model, tokens.to(model.embed.device), layer)
    if not 0 <= head < patterns.shape[0]:
        raise ValueError(f"head {head} does not exist; layer {layer} has heads 0..{patterns.shape[0] - 1}")
    return plot_attention(patterns[head].cpu(), labels, out, title=f"attention pattern, layer {layer}, head {head}")


def draw_logit_lens(model: TransformerLM, tokenizer: Any, prompt: str, out: str | os.PathLike) -> Path:
    """Encode `prompt`, run the logit lens, and save the grid picture to `out`."""
    tokens, labels = encode_prompt(tokenizer, prompt, model.config.context_length)
    top_ids, top_probs = logit_lens_top(model, tokens.to(model.embed.device))
    top_tokens = [[tokenizer.decode([int(i)]) for i in row] for row in top_ids.cpu()]
    return plot_logit_lens(top_tokens, top_probs.cpu(), labels, out,
                           title=LOGIT_LENS_TITLE)

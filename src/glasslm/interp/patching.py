"""Activation patching: run the corrupted prompt with one clean activation put back, and measure.

Each function caches the clean run once, then for every (layer, position) or (layer, head) runs the
corrupted prompt with that one slice of the activation replaced by its clean value, and returns
`metric(patched_logits)` in a grid. A metric near its clean value says the slice carries what
the corruption destroyed. `attribution_patching` approximates the same grid from one forward and
one backward pass: (clean - corrupted) activation times the metric's gradient on the corrupted run.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> torch.manual_seed(0) and None
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", n_layers=2)).eval()
    >>> clean, corrupted = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 6, 7, 8]])
    >>> metric = lambda logits: logits[0, -1, 10]
    >>> grid = patch_residual_stream(model, clean, corrupted, metric)  # (layers, seq)
    >>> grid.shape
    torch.Size([2, 4])
    >>> float(grid[0, 0]) == float(metric(model(clean).detach()))  # resid_pre 0 at the changed token is all of it
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.interp.hooks import run_with_cache, run_with_hooks

Metric = Callable[[Tensor], Tensor]


def _patch_grid(model: nn.Module, corrupted: Tensor, clean_cache: dict, names: list[str], n_cols: int,
                index_of: Callable[[int], tuple], metric: Metric) -> Float[Tensor, "layers cols"]:
    """metric after replacing activation[index_of(col)] of each named hook with its clean value."""
    grid = torch.zeros(len(names), n_cols)
    for row, name in enumerate(names):
        for col in range(n_cols):
            def put_back(activation, hook_name, index=index_of(col), name=name):
                patched = activation.clone()
                patched[index] = clean_cache[name][index]
                return patched
            grid[row, col] = float(metric(run_with_hooks(model, corrupted, [(name, put_back)])))
    return grid


@torch.no_grad()
def patch_by_position(model: nn.Module, clean: Int[Tensor, "batch seq"], corrupted: Int[Tensor, "batch seq"],
                      metric: Metric, hook: str) -> Float[Tensor, "layers seq"]:
    """Patch `blocks.{layer}.{hook}` (e.g. "hook_resid_pre", "hook_attn_out", "hook_mlp_out") one
    position at a time from the clean run into the corrupted one: (layers, seq) metric values."""
    if clean.shape != corrupted.shape:
        raise ValueError(f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} must have one shape")
    names = [f"blocks.{layer}.{hook}" for layer in range(len(model.blocks))]
    _, clean_cache = run_with_cache(model, clean, names_filter=names)
    return _patch_grid(model, corrupted, clean_cache, names, clean.shape[1],
                       lambda pos: (slice(None), pos), metric)


def patch_residual_stream(model: nn.Module, clean: Tensor, corrupted: Tensor, metric: Metric) -> Tensor:
    """`patch_by_position` on each block's input, hook_resid_pre: (layers, seq)."""
    return patch_by_position(model, clean, corrupted, metric, "hook_resid_pre")


def patch_attn_out(model: nn.Module, clean: Tensor, corrupted: Tensor, metric: Metric) -> Tensor:
    """`patch_by_position` on each attention output, hook_attn_out: (layers, seq)."""
    return patch_by_position(model, clean, corrupted, metric, "hook_attn_out")


def patch_mlp_out(model: nn.Module, clean: Tensor, corrupted: Tensor, metric: Metric) -> Tensor:
    """`patch_by_position` on each MLP output, hook_mlp_out: (layers, seq)."""
    return patch_by_position(model, clean, corrupted, metric, "hook_mlp_out")


@torch.no_grad()
def patch_heads(model: nn.Module, clean: Int[Tensor, "batch seq"], corrupted: Int[Tensor, "batch seq"],
                metric: Metric) -> Float[Tensor, "layers heads"]:
    """Patch each head's output (its slice of hook_z, every position) from clean into corrupted: (layers, heads)."""
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(len(model.blocks))]
    _, clean_cache = run_with_cache(model, clean, names_filter=names)
    return _patch_grid(model, corrupted, clean_cache, names, model.config.n_heads,
                       lambda head: (slice(None), slice(None), head), metric)


def attribution_patching(model: nn.Module, clean: Int[Tensor, "batch seq"], corrupted: Int[Tensor, "batch seq"],
                         metric: Metric, hook: str = "hook_resid_pre") -> Float[Tensor, "layers seq"]:
    """The first-order estimate of `patch_by_position`'s change in metric, for every layer and position
    at once: sum over d_model of (clean - corrupted activation) * d metric / d activation (corrupted run).

    Returns the estimated metric *change* (patched - corrupted), (layers, seq).
    """
    names = [f"blocks.{layer}.{hook}" for layer in range(len(model.blocks))]
    with torch.no_grad():
        _, clean_cache = run_with_cache(model, clean, names_filter=names)
    kept: dict[str, Tensor] = {}

    def keep_grad(activation: Tensor, name: str) -> None:
        activation.retain_grad()
        kept[name] = activation

    logits = run_with_hooks(model, corrupted, [(name, keep_grad) for name in names])
    metric(logits).backward()
    rows = [((clean_cache[name] - kept[name].detach()) * kept[name].grad).sum(dim=(0, -1)) for name in names]
    model.zero_grad(set_to_none=True)
    return torch.stack(rows)  # (layers, seq)


# TransformerLens's names and signature (model, corrupted_tokens, clean_cache, patching_metric), so its
# tutorials port by renaming the import. The clean cache must hold the patched hook for every layer.

def _tl_style(hook: str, by_head: bool) -> Callable:
    @torch.no_grad()
    def patch(model: nn.Module, corrupted_tokens: Tensor, clean_cache: dict, patching_metric: Metric) -> Tensor:
        names = [f"blocks.{layer}.{hook}" for layer in range(len(model.blocks))]
        if by_head:
            return _patch_grid(model, corrupted_tokens, clean_cache, names, model.config.n_heads,
                               lambda head: (slice(None), slice(None), head), patching_metric)
        return _patch_grid(model, corrupted_tokens, clean_cache, names, corrupted_tokens.shape[1],
                           lambda pos: (slice(None), pos), patching_metric)
    patch.__doc__ = f"TransformerLens-style patching of every layer's {hook}: (layers, {'heads' if by_head else 'seq'})."
    return patch


get_act_patch_resid_pre = _tl_style("hook_resid_pre", by_head=False)
get_act_patch_resid_mid = _tl_style("hook_resid_mid", by_head=False)
get_act_patch_attn_out = _tl_style("hook_attn_out", by_head=False)
get_act_patch_mlp_out = _tl_style("hook_mlp_out", by_head=False)
get_act_patch_attn_head_out_all_pos = _tl_style("attn.hook_z", by_head=True)

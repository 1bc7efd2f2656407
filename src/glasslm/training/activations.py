"""Activation checkpointing, per block: a block's forward keeps only its input for backward and runs
again inside backward to rebuild what the gradient needs (torch.utils.checkpoint, non-reentrant).
Peak memory then holds one block's activations instead of every block's, for about one more
forward pass of compute (benchmarks/bench_activation_checkpointing.py measures both).

The recomputation replays the same random numbers (checkpoint restores the RNG state), so the
gradients are bit-equal to the plain run's. The blocks' parameter names are unchanged (nothing is
wrapped: each block's forward is replaced on the instance), so checkpoints, FSDP2's per-block
sharding and torch.compile see the same model. Outside training or without grad (evaluation,
sampling, a KV cache) the block runs as before.

Example (the same gradient with and without):
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> _ = torch.manual_seed(0)
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=8, n_layers=2, context_length=8))
    >>> x = torch.randint(0, 8, (2, 8))
    >>> model(x).square().mean().backward(); plain = model.embed.weight.grad.clone(); model.zero_grad()
    >>> checkpoint_blocks(model)
    2
    >>> model(x).square().mean().backward()
    >>> torch.equal(model.embed.weight.grad, plain)
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from glasslm.core.model import TransformerLM


def checkpoint_blocks(model: TransformerLM) -> int:
    """Make every block of `model` recompute its activations in backward; returns how many blocks.
    Calling it twice is harmless (a block already checkpointed is left alone)."""
    count = 0
    for block in model.blocks:
        if not getattr(block, "_checkpointed", False):
            block.forward = functools.partial(_checkpointed_forward, block, type(block).forward.__get__(block))
            block._checkpointed = True
        count += 1
    return count


def _checkpointed_forward(block: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not (block.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)

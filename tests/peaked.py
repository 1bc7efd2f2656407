"""Test models whose logits are peaked, as a trained model's are, so greedy choices never hinge on float noise."""

from __future__ import annotations

import torch
from torch import nn


def peak_weights(model: nn.Module, std: float = 0.16) -> nn.Module:
    """Scale every weight matrix of `model` to standard deviation `std`, in place; returns `model`.

    Initial weights give nearly uniform logits, so greedy choices would hinge on float noise;
    larger weights make the distributions peaked. Every matrix gets the same std (8x GPT-2's 0.02)
    whatever the family's init: 8x Xavier weights (std 0.7) gave the Vaswani model attention scores
    near 1e4, where one float32 rounding of a score (~1e-3) moves the softmax, so float32 logits
    were 5e-5 of their scale from float64 on any kernel and two float32 paths agreed or not by the
    CPU's luck (issue 12).
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(std / p.std())
    return model

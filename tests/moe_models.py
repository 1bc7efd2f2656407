"""Mixture-of-experts test models: every weight moved off its initial value."""

from __future__ import annotations

import torch

from glasslm.core.model import TransformerLM


def perturbed_moe(config, scale: float = 0.05, seed: int = 0) -> TransformerLM:
    """Every weight moved off its initial value (by `scale` standard normals), the routers' 10x so that
    each token's experts are a clear choice (near-ties would be decided by rounding, differently in each library)."""
    torch.manual_seed(seed)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * scale)
            if "router" in name:
                p.mul_(10)
    return model

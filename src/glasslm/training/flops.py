"""Model FLOPs utilization (MFU): the share of the accelerator's peak a training run uses, counting
only the model's own arithmetic (recomputation, e.g. activation checkpointing, does not count).

FLOPs per trained token, the usual closed form (Kaplan et al. 2020; PaLM's appendix B):
6 N + 12 L d T, where N counts the weights of the matrix multiplications (every block's matrices and
the unembedding; embedding look-ups are not multiplications), L is the number of layers, d the
width of attention (heads x head size) and T the sequence length: 2 FLOPs per multiply-add, times 3
for forward and backward; the second term is attention's scores and weighted sum (causal masking's
half is not subtracted, by convention).

Example (GPT-2 small at 1024 tokens: 12 x 12 x 768^2 block weights + 50257 x 768 unembedding
= 123.5M, so 6 N = 0.741 GFLOPs, plus 12 x 12 x 768 x 1024 = 0.113 GFLOPs of attention):
    >>> from glasslm.presets import get_preset
    >>> config = get_preset("gpt2-small")
    >>> matmul_parameters(config), round(training_flops_per_token(config) / 1e9, 3)
    (123532032, 0.854)
    >>> round(mfu(tokens_per_second=100_000, flops_per_token=training_flops_per_token(config), peak_flops=989.4e12), 4)
    0.0864
"""

from __future__ import annotations

import torch

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM

# Dense bf16 tensor-core peak FLOP/s (no sparsity), from the vendors' data sheets, by device name.
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362.05e12, "A10G": 70e12,
                   "RTX 4090": 165.2e12}


def matmul_parameters(config: ModelConfig) -> int:
    """N of the closed form: the weights that take part in matrix multiplications (2-D or more:
    the blocks' matrices and the unembedding, tied or not), not embedding tables or norms."""
    with torch.device("meta"):
        model = TransformerLM(config)
    count = sum(p.numel() for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() >= 2)
    unembedding = model.embed.weight if model.unembed is None else model.unembed.weight
    return count + unembedding.numel()


def training_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """6 N + 12 L d T (see the module docstring); T defaults to the context length."""
    seq = seq_len or config.context_length
    attention_width = config.n_heads * config.d_head
    return 6 * matmul_parameters(config) + 12 * config.n_layers * attention_width * seq


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device named `device_name` (torch.cuda.get_device_name), if known.

    >>> peak_flops("NVIDIA H100 80GB HBM3"), peak_flops("cpu")
    (989400000000000.0, None)
    """
    return next((flops for name, flops in PEAK_BF16_FLOPS.items() if name in device_name), None)


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs per second over the peak: a fraction (0.4 is 40%)."""
    return tokens_per_second * flops_per_token / peak_flops

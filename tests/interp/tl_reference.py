"""Build the same tiny model in glasslm and in TransformerLens (via an HF export), for the comparison tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from glasslm.core.model import TransformerLM
from glasslm.hf.convert import export_hf
from glasslm.presets import get_preset
from glasslm.tokenizers import train_tokenizer_from_text

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 20
SHAPES = {  # GPT-2-shaped (LayerNorm, learned positions, biases) and Llama-shaped (RMSNorm, rotary, GQA, SwiGLU)
    "gpt2": dict(preset="gpt2-small", n_layers=2, d_model=64, n_heads=4),
    "llama": dict(preset="llama-tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2),
}
# Imported families from their HF config.json: Qwen3 (q/k norms) and Gemma 3 ((1 + w) norms, sandwich
# post-norms, q/k norms, scaled embeddings, a sliding-window layer and a global one).
FAMILY_SHAPES = {"qwen3": "qwen3", "gemma3": "gemma3_text"}


def tiny_config(shape: str, vocab_size: int):
    """A two-layer ModelConfig of the named shape (a preset, or an imported family's config)."""
    if shape in FAMILY_SHAPES:
        from glasslm.hf import config_from_hf
        from tests.hf.test_family_registry import HF_CONFIGS

        hf = {**HF_CONFIGS[FAMILY_SHAPES[shape]], "vocab_size": vocab_size, "max_position_embeddings": 32}
        return config_from_hf(hf)[0]
    kwargs = dict(SHAPES[shape])
    return get_preset(kwargs.pop("preset"), vocab_size=vocab_size, context_length=32, **kwargs)


@torch.no_grad()
def perturb(model: TransformerLM, scale: float = 4.0) -> TransformerLM:
    """Non-trivial norm gains and biases (noise), sharper matrices: initial values hide bugs."""
    for name, p in model.named_parameters():
        if name.endswith("bias") or "ln" in name or "norm" in name:
            p.add_(torch.randn_like(p) * 0.1)
        elif p.dim() == 2:
            p.mul_(scale)  # sharper than the init, so patterns and MLPs are far from uniform
    return model


def reference_tokenizer():
    """The 300-token BPE both models read (its `<|endoftext|>` is bos, eos and pad)."""
    return train_tokenizer_from_text(TEXT, vocab_size=300)


def build_pair(shape: str, folder: Path, processing: bool = False):
    """(glasslm model, TransformerBridge) with the same random weights; biases made non-zero so they count."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = reference_tokenizer()
    torch.manual_seed(0)
    model = perturb(TransformerLM(tiny_config(shape, tokenizer.vocab_size)).eval())
    export_hf(model, folder, tokenizer)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf_model,
                                                 tokenizer=AutoTokenizer.from_pretrained(folder), device="cpu")
    if processing:
        bridge.enable_compatibility_mode(disable_warnings=True)
    else:
        bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    return model, bridge

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


def build_pair(shape: str, folder: Path, processing: bool = False):
    """(glasslm model, TransformerBridge) with the same random weights; biases made non-zero so they count."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = train_tokenizer_from_text(TEXT, vocab_size=300)
    kwargs = dict(SHAPES[shape])
    torch.manual_seed(0)
    config = get_preset(kwargs.pop("preset"), vocab_size=tokenizer.vocab_size, context_length=32, **kwargs)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name:
                p.add_(torch.randn_like(p) * 0.1)  # non-trivial norm gains and biases
            elif p.dim() == 2:
                p.mul_(4.0)  # sharper than the init, so patterns and MLPs are far from uniform
    export_hf(model, folder, tokenizer)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf_model,
                                                 tokenizer=AutoTokenizer.from_pretrained(folder), device="cpu")
    if processing:
        bridge.enable_compatibility_mode(disable_warnings=True)
    else:
        bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    return model, bridge

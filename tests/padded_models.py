"""A model with more embedding rows than its tokenizer has tokens, as Pythia (50,304 rows for 50,277
tokens) and Qwen2.x (151,936 for ~151,665) ship: a tiny random Qwen3 with 50,304 rows, saved by
transformers' own `save_pretrained` beside GPT-2's tokenizer with two added special tokens (50,259
tokens), so ids 50,259..50,303 are padding.

The padding rows of the output matrix are scaled up, so that the model puts most of its probability
on them (a trained model gives them little, but nothing stops a sampler from drawing one): any path
that fails to mask them picks them at once.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROWS = 50304
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def gpt2_hf_tokenizer(gpt2_files: tuple[Path, Path]):
    from transformers import GPT2TokenizerFast

    vocab, merges = gpt2_files
    tokenizer = GPT2TokenizerFast(vocab=str(vocab), merges=str(merges))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tokenizer


def padded_qwen3_dir(directory: Path, gpt2_files: tuple[Path, Path], padding_scale: float = 100.0):
    """(directory, transformers model, transformers tokenizer) of the padded Qwen3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = gpt2_hf_tokenizer(gpt2_files)
    config = Qwen3Config(vocab_size=ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=50256, eos_token_id=50256)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[len(tokenizer):] *= padding_scale
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer

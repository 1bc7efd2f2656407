"""`glasslm info`: parameters and FLOPs per token of a preset or checkpoint, by component."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from glasslm.cli.command import Command
from glasslm.cli.options import Group
from glasslm.core.config import ModelConfig
from glasslm.presets import PRESETS, get_preset


PresetName = Literal[tuple(sorted(PRESETS))]  # type: ignore[valid-type]


@dataclass
class InfoConfig:
    """what to describe (--preset or --checkpoint)"""

    preset: PresetName | None = None  # the preset to describe
    # instead of --preset: a glasslm checkpoint or run directory, HF directory, cached hub name or GGUF file
    checkpoint: str | None = None
    json: bool = False  # also print the full config


MODEL_OVERRIDES = Group("model settings (override the preset's or checkpoint's)")


def info(config: InfoConfig, model: Annotated[dict[str, Any], ModelConfig, MODEL_OVERRIDES]) -> int:
    from glasslm.interp.accounting import format_cost_table

    # --context-length (a ModelConfig option) sets the model's context and the FLOPs' context alike.
    if config.checkpoint:
        cfg = _print_checkpoint_info(config.checkpoint).replace(**model)
    elif config.preset:
        cfg = get_preset(config.preset, **model)
    else:
        raise ValueError("info needs --preset NAME or --checkpoint PATH")
    print(format_cost_table(cfg, title=config.preset or config.checkpoint))
    if config.json:
        print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def _print_checkpoint_info(path: str) -> ModelConfig:
    """What `glasslm info --checkpoint` says before the cost table (kind, tokenizer, provenance);
    returns the checkpoint's config."""
    from glasslm.hf import checkpoint_config, family_of, is_hf_directory, resolve_model_path
    from glasslm.hf.load import gguf_path
    from glasslm.tokenizers import special_token_ids

    config, tokenizer, summary = checkpoint_config(path)
    resolved = resolve_model_path(path)
    kind = ("GGUF file" if gguf_path(resolved) is not None else
            "Hugging Face directory" if is_hf_directory(resolved) else "glasslm checkpoint")
    try:
        family = family_of(config)
    except ValueError:
        family = "none (glasslm only)"
    print(f"{path}: {kind} at {resolve_model_path(path)}; Hugging Face family: {family}")
    if tokenizer is None:
        print("tokenizer: none")
    else:
        ids = {k: v for k, v in special_token_ids(tokenizer).items() if v is not None}
        print(f"tokenizer: {tokenizer.kind}, {tokenizer.vocab_size:,} tokens, special ids {ids or 'none'}")
    if kind == "GGUF file":
        from glasslm.hf.gguf.importer import gguf_storage

        print(f"tensors: {gguf_storage(gguf_path(resolved))}")
    known = {k: v for k, v in summary.items() if v is not None}
    if known:
        print("history: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in known.items()))
    return config


COMMAND = Command("info", info, "parameters and FLOPs per token of a preset or checkpoint, by component",
                  examples=(
                      'glasslm info --preset gpt2-small',
                      'glasslm info --preset shakespeare-char-cpu --n-layers 8',
                      'glasslm info --checkpoint runs/shakespeare-char-cpu',
                  ))

"""Fine-tuning a pretrained model on conversations: LoRA, QLoRA (a quantized frozen base) or every
weight, trained by the same loop as pretraining (glasslm.training.loop) on padded conversations
whose loss covers only the assistant's tokens (glasslm.training.batches.SFTBatches).

- `FinetuneConfig`: the method and the adapters' shape.
- `prepare_model`: the base (any checkpoint `glasslm.hf.load_model` reads), quantized and given
  adapters as asked; returns the metadata that makes the run's checkpoints adapter checkpoints
  (only the adapters' tensors, plus the base's path and a hash of its weights).
- `chat_batches`: a chat / instruction JSONL (or a preference JSONL, for DPO) rendered with the
  chat template, split into training and held-out conversations.
- `merge_adapters`: a plain model with the adapters written into its weights (a QLoRA base is
  dequantized first: the merged weights are the dequantized base plus the update).

Example (a LoRA model on a tiny base: only the adapters train):
    >>> import tempfile
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.io.checkpoint import save_checkpoint
    >>> from glasslm.presets import get_preset
    >>> base = save_checkpoint(tempfile.mkdtemp() + "/base", TransformerLM(get_preset("llama-tiny", n_layers=1)))
    >>> model, _, meta = prepare_model(str(base), FinetuneConfig(lora_rank=2))
    >>> sorted({n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad}), "adapter_of" in meta
    (['lora_a', 'lora_b'], True)
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from glasslm.core.layers import Embedding, Linear
from glasslm.core.model import TransformerLM
from glasslm.data.sft import load_sft_examples, split_examples
from glasslm.io.checkpoint import ADAPTER_BASE_KEY, weights_sha256
from glasslm.data.preferences import load_preference_pairs
from glasslm.training.batches import BatchSource, PreferenceBatches, SFTBatches
from glasslm.transforms import applied_transforms, apply_transform, transform_names
from glasslm.transforms.lora import SITES, LoRAConfig, lora_layers, remove_lora
from glasslm.transforms.ggml import BlockEmbedding, BlockLinear
from glasslm.transforms.split import RowSplitLinear
from glasslm.transforms.quantize import Int4Linear, Int8Linear

FINETUNE_KEY = "finetune"  # meta.json: how the run was set up (base, method, data), for --resume


@dataclass
class FinetuneConfig:
    """fine-tuning method"""

    # sft: learn the assistant turns of conversations; dpo: prefer each record's chosen completion to
    # its rejected one (preference JSONL: prompt, chosen, rejected; glasslm.training.dpo); simpo: the
    # same without a reference model, on each answer's mean token log-probability; orpo: the chosen
    # answer's supervised loss plus an odds-ratio preference term, no reference; grpo: raise a reward on
    # sampled answers (problem JSONL: prompt, answer; glasslm.training.grpo)
    method: Literal["sft", "dpo", "simpo", "orpo", "grpo"] = "sft"
    # DPO, SimPO, ORPO: the β of the reward (DPO: a smaller β lets the model move further from the
    # reference; ORPO: the weight λ of the odds-ratio term)
    dpo_beta: float = 0.1
    simpo_gamma: float = 0.5  # SimPO: the margin γ the chosen answer's reward must clear
    # GRPO: exact_match, regex:PATTERN, MODULE:FUNCTION or file.py:FUNCTION (glasslm.evaluation.rewards)
    reward: str | None = None
    group_size: int = field(default=4, metadata={"minimum": 2})  # GRPO: completions sampled per prompt
    max_new_tokens: int = field(default=32, metadata={"minimum": 1})  # GRPO: the longest completion sampled
    # GRPO: the sampling temperature; the log-probabilities the loss uses are of the same tempered
    # distribution (TRL's temperature). A small model's answers at 1 are often too noisy to earn a reward
    temperature: float = 1.0
    # GRPO: weight of the KL term to the reference (0: none, no reference kept). TRL 1.16: 0; 0.04 is the
    # GRPO paper's (and TRL's before), which holds a small model near its base while rewards are sparse
    grpo_beta: float = 0.04
    grpo_epsilon: float = 0.2  # GRPO: the probability ratio is clipped to [1 - ε, 1 + ε]
    full: bool = False  # train every weight instead of LoRA adapters
    # LoRA defaults: measured on the demo model (docs/training.md#choosing-the-lora-defaults), where
    # adapters on q,v alone (with lr 2e-4, glasslm's defaults before) left the answers unlearned
    lora_rank: int = field(default=8, metadata={"minimum": 1})  # LoRA: the adapters' inner width r
    lora_alpha: float = 16.0  # LoRA: the update is scaled by alpha / rank
    # LoRA: comma-separated sites: q, k, v, attn_out, mlp_up, mlp_gate, mlp_down, unembed, embed (a
    # model without one, e.g. GPT-2's gate, just has no adapter there)
    lora_sites: str = "q,k,v,attn_out,mlp_up,mlp_gate,mlp_down"
    lora_dropout: float = 0.0  # LoRA: dropout on the adapters' input while training
    lora_dora: bool = False  # LoRA: DoRA, a learned length for each adapted output row (PEFT's use_dora)
    lora_rslora: bool = False  # LoRA: scale by alpha / sqrt(rank) (rsLoRA; PEFT's use_rslora)
    # LoRA: biases that train too: none, lora_only (those of the adapted maps), all (PEFT's bias)
    lora_bias: Literal["none", "lora_only", "all"] = "none"
    # LoRA: comma-separated modules trained whole beside the adapters: embed, unembed (PEFT's modules_to_save)
    lora_full: str = ""
    # hold the frozen base in int8 or int4 (QLoRA); none: fp32
    quantize: Literal["none", "int8", "int4"] = "none"
    chat_template: str | None = field(default=None, metadata={"metavar": "FILE"})  # Jinja chat template; none: the base's
    val_fraction: float = 0.1  # share of the conversations held out for the validation loss

    def lora(self) -> LoRAConfig:
        sites = tuple(s.strip() for s in self.lora_sites.split(",") if s.strip())
        full = tuple(s.strip() for s in self.lora_full.split(",") if s.strip())
        try:
            return LoRAConfig(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout, sites=sites,
                              dora=self.lora_dora, rslora=self.lora_rslora, bias=self.lora_bias, full=full)
        except ValueError as err:
            raise ValueError(f"--lora-sites/--lora-rank/--lora-dropout/--lora-full: {err} "
                             f"(sites: {', '.join(SITES)})") from None

    def check(self) -> None:
        if self.quantize != "none" and self.quantize not in transform_names("quantization"):
            raise ValueError(f"quantize: unknown method {self.quantize!r}")
        if self.full and self.quantize != "none":
            raise ValueError("--full trains every weight, which a quantized base cannot; drop --quantize "
                             "(QLoRA is LoRA on a quantized base)")
        if not self.full:
            self.lora()
        if self.method not in ("sft", "dpo", "simpo", "orpo", "grpo"):
            raise ValueError(f"method: unknown fine-tuning method {self.method!r} (sft, dpo, simpo, orpo, grpo)")
        if self.method in ("dpo", "simpo", "orpo") and not self.dpo_beta > 0:
            raise ValueError(f"--dpo-beta must be positive, got {self.dpo_beta}")
        if self.method == "grpo":
            self._check_grpo()
        base_reference = self.method == "dpo" or (self.method == "grpo" and self.grpo_beta != 0)
        if base_reference and not self.full and (self.lora_bias != "none" or self.lora_full.strip()):
            raise ValueError(f"--method {self.method} with LoRA uses the base (adapters off) as its reference, which "
                             "biases and whole modules trained in place (--lora-bias, --lora-full) would change; drop them")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")


    def _check_grpo(self) -> None:
        if not self.reward:
            raise ValueError("--method grpo needs --reward: exact_match, regex:PATTERN, MODULE:FUNCTION or file.py:FUNCTION")
        if self.group_size < 2 or self.max_new_tokens < 1:
            raise ValueError(f"--group-size must be at least 2 and --max-new-tokens at least 1, got {self.group_size} "
                             f"and {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be positive (GRPO samples), got {self.temperature}")
        if not self.grpo_epsilon > 0 or not self.grpo_beta >= 0:
            raise ValueError(f"--grpo-epsilon must be positive and --grpo-beta at least 0, got {self.grpo_epsilon} "
                             f"and {self.grpo_beta}")


# LoRA's learning rate by the base's size (`lora_learning_rate`): 3e-3 at 10M parameters and below (measured
# on the 0.8M demo model), falling with the square root of the size, to 1e-4 (about 1e-3 at SmolLM2's 135M,
# where 1e-3 learned a new fact in 60 steps, and 1e-4 to 2e-4 for 7B bases, where LoRA usually trains).
LORA_LR_SMALL, LORA_LR_FLOOR, LORA_LR_SIZE = 3e-3, 1e-4, 10_000_000
# Preference tuning moves a model further per step than supervised tuning: at LoRA's supervised rate,
# 12 DPO steps already broke the demo model's chat answers, at a third of it they did not (docs/training.md)
PREFERENCE_LR_SHARE = 1 / 3


def lora_learning_rate(n_parameters: int, method: str = "sft") -> float:
    """LoRA's default learning rate for a base of `n_parameters`: 3e-3 × √(10M / n), within [1e-4, 3e-3];
    a third of it for the preference methods (dpo, simpo, orpo).

    >>> lora_learning_rate(788_096), round(lora_learning_rate(134_515_008), 5), round(lora_learning_rate(7e9), 5)
    (0.003, 0.00082, 0.00011)
    >>> lora_learning_rate(788_096, "dpo")
    0.001
    """
    rate = min(LORA_LR_SMALL, max(LORA_LR_FLOOR, LORA_LR_SMALL * (LORA_LR_SIZE / max(n_parameters, 1)) ** 0.5))
    return rate * (PREFERENCE_LR_SHARE if method in ("dpo", "simpo", "orpo") else 1.0)


def base_reference(path: str | os.PathLike) -> str:
    """How a checkpoint names its base: the exact checkpoint directory, absolute (a run directory's
    best checkpoint: the run may train on and move `best`), or GGUF file, if local; else the hub name."""
    from glasslm.hf import is_hf_directory
    from glasslm.hf.load import gguf_path
    from glasslm.io.checkpoint import resolve_checkpoint

    local = Path(path)
    if not local.exists():
        return str(path)
    exact = gguf_path(local) or (local if is_hf_directory(local) else resolve_checkpoint(local))
    return str(exact.resolve())


def prepare_model(base: str, config: FinetuneConfig, device: torch.device | str = "cpu",
                  seed: int = 0, merge_into: str | os.PathLike | None = None,
                  overwrite: bool = False) -> tuple[TransformerLM, Any, dict[str, Any]]:
    """(model to train, tokenizer, meta for its checkpoints) from the base checkpoint `base`.

    LoRA: every base weight frozen, adapters added (after quantizing the base for QLoRA), and the
    meta names the base and its weights' hash so checkpoints hold only the adapters; the adapters'
    initial A matrices are drawn from `seed` (the caller's random stream is left alone). Full: all
    weights train and checkpoints are whole models.

    A `base` that holds LoRA adapters (a fine-tuning run: DPO after SFT) is refused, unless `merge_into`
    names a directory: the adapters are then merged into their base there (`merge_adapters`; with its
    chat template, `overwrite` replacing what the directory holds), and that full model is the base,
    the reference, and what the run's checkpoints name; meta's finetune record says `merged_from`.
    (TRL trains a second adapter on top of the first; merging gives the same starting model.)
    """
    config.check()
    model, tokenizer, from_gguf = _load_base(base, config, device)
    merged_from = None
    if lora_layers(model) and merge_into is not None:
        merged_from, base = base_reference(base), str(Path(merge_into).resolve())
        model = _write_merged_base(model, tokenizer, merged_from, Path(merge_into), overwrite)
    if applied_transforms(model) and not from_gguf:
        raise ValueError(f"--checkpoint {base} is already transformed ({applied_transforms(model)}); "
                         "fine-tune plain weights (merge an adapter checkpoint first: glasslm merge)")
    if from_gguf and applied_transforms(model) and config.quantize != "none":
        raise ValueError(f"--checkpoint {base}'s matrices are already 4-bit blocks, which LoRA trains on as they "
                         "are (QLoRA on the file's own quantization); drop --quantize")
    record = {"base": base_reference(base), **asdict(config)} | ({"merged_from": merged_from} if merged_from else {})
    meta: dict[str, Any] = {FINETUNE_KEY: record}
    if config.full:
        for p in model.parameters():
            p.requires_grad_(True)
        return model.train(), tokenizer, meta
    meta[ADAPTER_BASE_KEY] = {"path": record["base"], "sha256": weights_sha256(model.state_dict())}
    if config.quantize != "none":
        apply_transform(model, config.quantize)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        apply_transform(model, "lora", config.lora())
    return model.train(), tokenizer, meta


def _write_merged_base(model: TransformerLM, tokenizer: Any, source: str, directory: Path,
                       overwrite: bool) -> TransformerLM:
    """`model`'s adapters merged into its weights, saved to `directory` (a glasslm checkpoint with the
    adapter checkpoint's chat template), and returned as loaded from there."""
    from glasslm.hf import load_chat_template, load_model
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.locations import check_output_dir

    check_output_dir(directory, overwrite, inputs=[source], what="merged base")
    template = load_chat_template(source, tokenizer)
    merged, _ = merge_adapters(model)
    save_checkpoint(directory, merged, tokenizer, {"merged_from": source}, chat_template=template)
    return load_model(directory)[0]


def _load_base(base: str, config: FinetuneConfig, device: torch.device | str) -> tuple[TransformerLM, Any, bool]:
    """(model, tokenizer, whether it is a GGUF file). A GGUF base keeps its 4-bit blocks for LoRA (the
    file's own quantization is the frozen base, as QLoRA's would be); --full needs every weight in float."""
    from glasslm.hf import load_model, resolve_model_path
    from glasslm.hf.load import gguf_path

    gguf = gguf_path(resolve_model_path(base))
    if gguf is not None and config.full:
        from glasslm.hf.gguf.importer import import_gguf

        loaded = import_gguf(gguf, device, keep_blocks=False)
        return loaded.model, loaded.tokenizer, True
    model, tokenizer = load_model(base, device)
    return model, tokenizer, gguf is not None


def chat_template(base: str, tokenizer: Any, config: FinetuneConfig) -> str:
    """The template conversations are rendered with: --chat-template FILE, else the base's own
    (`glasslm.hf.load_chat_template`, the lookup every command makes)."""
    from glasslm.hf import load_chat_template

    found = load_chat_template(base, tokenizer, config.chat_template)
    if found is None:
        raise ValueError(f"--checkpoint {base} has no chat template (chat_template.jinja or tokenizer_config.json); "
                         "give one with --chat-template FILE")
    return found


def chat_batches(data: str | os.PathLike, tokenizer: Any, template: str, context_length: int,
                 val_fraction: float, seed: int, preferences: bool = False) -> tuple[BatchSource, BatchSource | None]:
    """(training, validation) batch sources from a chat / instruction JSONL file, or with
    `preferences` from a preference JSONL file (glasslm.data.preferences: DPO's pairs)."""
    if tokenizer is None:
        raise ValueError("the base holds no tokenizer, so the conversations cannot be encoded")
    load, source = (load_preference_pairs, PreferenceBatches) if preferences else (load_sft_examples, SFTBatches)
    train_examples, val_examples = split_examples(load(data, tokenizer, template), val_fraction, seed)
    return (source(train_examples, context_length),
            source(val_examples, context_length) if val_examples else None)


@torch.no_grad()
def dequantize(model: nn.Module) -> int:
    """Replace every int8/int4/block layer by a float `Linear` holding its dequantized weight (a row
    split's parts joined into one, a block embedding by a float table), in place; returns how many
    were replaced. The model then computes what it computed quantized, but for a tied model's
    quantized unembedding, a copy of the embedding, which goes: the model unembeds with the float
    embedding again (for a GGUF file's blocks, exactly their values)."""
    replaced = 0
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    if isinstance(getattr(model, "embed", None), BlockEmbedding):
        table = model.embed.weight                                                   # (vocab, d_model)
        model.embed = Embedding(*table.shape).to(table.device)
        model.embed.weight.copy_(table)
        replaced += 1
    for name, module in list(model.named_modules()):
        if not isinstance(module, (Int8Linear, Int4Linear, BlockLinear, RowSplitLinear)) or ".parts." in name:
            continue
        if tied and name == "unembed":
            model.unembed = None
            replaced += 1
            continue
        weight = module.weight if isinstance(module, RowSplitLinear) else module.dequantized_weight(torch.float32)
        linear = Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None).to(weight.device)
        linear.weight.copy_(weight)
        if module.bias is not None:
            linear.bias.copy_(module.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)
        replaced += 1
    return replaced


def merge_adapters(model: TransformerLM) -> tuple[TransformerLM, bool]:
    """(plain model with the adapters merged into its weights, whether a quantized base was
    dequantized first). The transform record is cleared: the result is ordinary weights."""
    if not lora_layers(model):
        raise ValueError("this model has no LoRA adapters to merge")
    dequantized = False
    for layer in lora_layers(model).values():
        dequantized |= dequantize(layer) > 0 if isinstance(layer.base, (Int8Linear, Int4Linear, BlockLinear)) else False
    remove_lora(model, merge=True)
    dequantized |= dequantize(model) > 0  # the unadapted quantized layers of a QLoRA base
    model.applied_transforms = []
    for p in model.parameters():
        p.requires_grad_(False)
    return model, dequantized

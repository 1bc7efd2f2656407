"""`glasslm merge --checkpoint ADAPTER --out DIR`: a LoRA / QLoRA checkpoint as a full model, the
adapters written into the base's weights (a quantized base is dequantized first), as a glasslm
checkpoint or, with --to-hf, a Hugging Face directory that transformers loads."""

from __future__ import annotations

from dataclasses import dataclass

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, OutputOption


@dataclass
class MergeConfig:
    """output format"""

    to_hf: bool = False  # write a Hugging Face directory (config.json + model.safetensors) instead of a glasslm checkpoint


def merge(source: CheckpointOption, config: MergeConfig, output: OutputOption) -> int:
    from glasslm.hf import checkpoint_summary, export_hf, load_chat_template, load_model
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.locations import check_output_dir
    from glasslm.training.finetune import merge_adapters

    check_output_dir(output.out, output.overwrite, inputs=[source.checkpoint], what="merged model")
    model, tokenizer = load_model(source.checkpoint, base=source.base)
    template = load_chat_template(source.checkpoint, tokenizer)  # the merged model keeps the one it was tuned with
    model, dequantized = merge_adapters(model)
    if config.to_hf:
        export_hf(model, output.out, tokenizer, checkpoint_summary(source.checkpoint), chat_template=template)
    else:
        save_checkpoint(output.out, model, tokenizer, {"merged_from": str(source.checkpoint)}, chat_template=template)
    how = ("the dequantized base plus the adapters' update (the base was quantized: the merged fp32 weights "
           "compute what the quantized model with adapters computed (up to the int kernels' bf16 rounding of "
           "activations), not the original fp32 base plus the update)"
           if dequantized else "the base plus the adapters' update")
    print(f"wrote {output.out}: {'Hugging Face' if config.to_hf else 'glasslm'} model, weights = {how}")
    return 0


COMMAND = Command("merge", merge, "write a LoRA/QLoRA checkpoint as a full model (adapters merged into the weights)",
                  examples=(
                      'glasslm merge --checkpoint runs/ft --out runs/ft-merged',
                      'glasslm merge --checkpoint runs/ft --out runs/ft-hf --to-hf',
                  ))

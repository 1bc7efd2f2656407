"""`glasslm quantize --checkpoint DIR --out DIR`: a weight-only int8, int4 or llama.cpp-block (q4_0, q4_1) copy of a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, OutputOption
from glasslm.transforms import apply_transform, transform_names


@dataclass
class QuantizeConfig:
    """quantization"""

    # int8: one scale per output channel; int4: a scale and zero per group of 64 inputs; q4_0 / q4_1: llama.cpp's
    # blocks of 32 (a scale, and q4_1 a minimum, per block)
    method: str = field(default="int8", metadata={"choices": lambda: transform_names("quantization")})


def quantize(source: CheckpointOption, config: QuantizeConfig, output: OutputOption) -> int:
    from glasslm.hf import load_chat_template, load_model
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.locations import check_output_dir

    out = Path(output.out)
    # The one output rule (glasslm.locations): never the checkpoint itself, a file, or a full directory.
    inputs = [source.checkpoint] if Path(source.checkpoint).exists() else []
    check_output_dir(out, output.overwrite, inputs=inputs, what="quantized checkpoint")
    model, tokenizer = load_model(source.checkpoint, device="cpu", base=source.base)
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    apply_transform(model, config.method)  # recorded: the checkpoint's meta.json names it, loading re-applies it
    after = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    save_checkpoint(out, model, tokenizer, {"quantized_from": str(source.checkpoint)},
                    chat_template=load_chat_template(source.checkpoint, tokenizer))
    print(f"wrote {out}: {config.method} weights, {after / 1e6:.1f} MB (was {before / 1e6:.1f} MB)")
    return 0


COMMAND = Command("quantize", quantize,
                  "write a weight-only int8, int4, q4_0 or q4_1 copy of a checkpoint (for generate/eval/serve)",
                  examples=(
                      'glasslm quantize --checkpoint runs/shakespeare-char-cpu --method int8 --out runs/shakespeare-char-cpu-int8',
                  ))

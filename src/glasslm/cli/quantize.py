"""`glasslm quantize --checkpoint DIR --out DIR`: a weight-only int8 or int4 copy of a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, OutputOption


@dataclass
class QuantizeConfig:
    """quantization"""

    method: Literal["int8", "int4"] = "int8"  # int8: one scale per output channel; int4: a scale and zero per
                                              # group of 64 inputs


def quantize(source: CheckpointOption, config: QuantizeConfig, output: OutputOption) -> int:
    from glasslm.hf.interop import load_model
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.transforms.quantize import quantize as quantize_model

    out = Path(output.out)
    if Path(source.checkpoint).exists() and out.resolve() == Path(source.checkpoint).resolve():
        raise ValueError(f"--out {out} is the checkpoint itself; write the quantized copy elsewhere (the fp32 "
                         "weights would be replaced)")
    if out.is_file():
        raise ValueError(f"--out {out} is a file, not a directory")
    if out.exists() and any(out.iterdir()) and not output.overwrite:
        raise ValueError(f"{out} is not empty; pass --overwrite to replace it")
    model, tokenizer = load_model(source.checkpoint, device="cpu")
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    quantize_model(model, config.method)
    after = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    save_checkpoint(out, model, tokenizer, {"quantization": config.method, "quantized_from": str(source.checkpoint)})
    print(f"wrote {out}: {config.method} weights, {after / 1e6:.1f} MB (was {before / 1e6:.1f} MB)")
    return 0


COMMAND = Command("quantize", quantize,
                  "write a weight-only int8 or int4 copy of a checkpoint (for generate/eval/serve)")

"""`glasslm inspect attention|logit-lens`: draw what a model attends to or predicts layer by layer (PNG)."""

from __future__ import annotations

from dataclasses import dataclass

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, DeviceOptions, load_for_inference


@dataclass
class Drawing:
    """the picture"""

    prompt: str  # the text to run through the model
    out: str  # PNG file to write


@dataclass
class HeadChoice:
    """the head"""

    layer: int  # layer index, from 0
    head: int  # head index within the layer, from 0


def attention(source: CheckpointOption, drawing: Drawing, head: HeadChoice, runtime: DeviceOptions) -> int:
    from glasslm.interp.inspection import draw_attention

    model, tokenizer = load_for_inference(source.checkpoint, runtime, need_tokenizer=False, base=source.base)
    print(f"wrote {draw_attention(model, tokenizer, drawing.prompt, head.layer, head.head, drawing.out)}")
    return 0


def logit_lens(source: CheckpointOption, drawing: Drawing, runtime: DeviceOptions) -> int:
    from glasslm.interp.inspection import draw_logit_lens

    model, tokenizer = load_for_inference(source.checkpoint, runtime, need_tokenizer=False, base=source.base)
    print(f"wrote {draw_logit_lens(model, tokenizer, drawing.prompt, drawing.out)}")
    return 0


COMMAND = Command("inspect", None, "draw attention patterns or the logit lens (PNG)", subcommands=(
    Command("attention", attention, "one head's attention pattern, tokens on both axes", examples=(
        'glasslm inspect attention --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --layer 0 --head 1 --out attn.png',)),
    Command("logit-lens", logit_lens, "top next token read from every layer, as a grid", examples=(
        'glasslm inspect logit-lens --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --out lens.png',)),
))

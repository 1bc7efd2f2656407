"""`glasslm serve --checkpoint DIR`: the OpenAI-compatible completions server and the explorer page."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, RuntimeOptions, load_for_inference
from glasslm.serving.config import ServeConfig


def serve(source: CheckpointOption, config: ServeConfig, runtime: RuntimeOptions) -> int:
    try:
        from glasslm.serving.server import serve as serve_model
        import fastapi, uvicorn  # noqa: F401
    except ImportError:
        raise RuntimeError("serving needs fastapi and uvicorn: pip install fastapi uvicorn") from None
    model, tokenizer = load_for_inference(source.checkpoint, runtime, decoding=True)
    if config.name is None:
        config = dataclasses.replace(config, name=Path(source.checkpoint).resolve().name)
    if config.api_key is None and os.environ.get("GLASSLM_API_KEY"):  # the environment keeps it out of `ps`
        config = dataclasses.replace(config, api_key=os.environ["GLASSLM_API_KEY"])
    serve_model(model, tokenizer, config, chat_template_of(source.checkpoint, config.chat_template))
    return 0


def chat_template_of(checkpoint: str, template_file: str | None) -> str | None:
    """The chat template to use: `template_file`'s text if given, else the checkpoint's own, else None."""
    from glasslm.hf.cache import resolve_model_path
    from glasslm.hf.gguf import GGUFFile
    from glasslm.hf.load import gguf_path
    from glasslm.hf.peft import is_peft_directory, peft_base
    from glasslm.io.checkpoint import resolve_checkpoint
    from glasslm.tokenizers.chat import find_chat_template

    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(f"--chat-template {template_file}: no such file")
        return path.read_text(encoding="utf-8")
    directory = resolve_model_path(checkpoint)
    gguf = gguf_path(directory)
    if gguf is not None:  # a GGUF file carries its template in its metadata
        return GGUFFile.open(gguf).metadata.get("tokenizer.chat_template")
    if is_peft_directory(directory):  # the template saved beside the adapter, else its base's
        return find_chat_template(directory) or chat_template_of(str(peft_base(directory)), None)
    if not (directory / "config.json").is_file():  # a run directory: its best (else latest) checkpoint
        directory = resolve_checkpoint(directory)
    return find_chat_template(directory)


COMMAND = Command("serve", serve,
                  "OpenAI-compatible completions server and the explorer page (needs fastapi, uvicorn)",
                  examples=(
                      'glasslm serve --checkpoint runs/shakespeare              # explorer at http://127.0.0.1:8000',
                      'glasslm serve --checkpoint runs/shakespeare --port 8001 --max-batch 8',
                  ))

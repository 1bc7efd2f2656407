"""`glasslm serve --checkpoint DIR`: the OpenAI-compatible completions server and the explorer page."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, RuntimeOptions, load_for_inference
from glasslm.serving.config import ServeConfig


def serve(source: CheckpointOption, config: ServeConfig, runtime: RuntimeOptions) -> int:
    from glasslm.hf import load_chat_template
    from glasslm.training.loggers import run_metrics_file

    try:
        from glasslm.serving.server import serve as serve_model
        import fastapi, uvicorn  # noqa: F401
    except ImportError:
        raise RuntimeError("serving needs fastapi and uvicorn: pip install fastapi uvicorn") from None
    model, tokenizer = load_for_inference(source.checkpoint, runtime, decoding=True, base=source.base)
    if config.name is None:
        config = dataclasses.replace(config, name=served_name(source.checkpoint))
    if config.api_key is None and os.environ.get("GLASSLM_API_KEY"):  # the environment keeps it out of `ps`
        config = dataclasses.replace(config, api_key=os.environ["GLASSLM_API_KEY"])
    serve_model(model, tokenizer, config, load_chat_template(source.checkpoint, tokenizer, config.chat_template),
                run_metrics_file(source.checkpoint))
    return 0


def served_name(checkpoint: str) -> str:
    """The model name a server started on `checkpoint` answers to without --name (clients' `model`):
    the checkpoint's folder or file name.

    >>> served_name("runs/shakespeare-char-cpu")
    'shakespeare-char-cpu'
    """
    return Path(checkpoint).resolve().name


COMMAND = Command("serve", serve,
                  "OpenAI-compatible completions server and the explorer page (needs fastapi, uvicorn)",
                  examples=(
                      'glasslm serve --checkpoint runs/shakespeare-char-cpu              # explorer at http://127.0.0.1:8000',
                      'glasslm serve --checkpoint runs/shakespeare-char-cpu --port 8001 --max-batch 8',
                  ))

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
    if runtime.threads == 0:
        measure_threads(model, tokenizer)
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


def measure_threads(model, tokenizer) -> None:
    """--threads 0 (automatic) on a CPU: the fastest count for a served stream, measured here
    (`serving.threads.fastest_threads`), among 1 to the cores the machine's load leaves free. Not where
    OMP_NUM_THREADS chose, nor for models under the one-thread size (`runtime.choose_threads`)."""
    import sys

    import torch

    from glasslm.runtime import ONE_THREAD_BELOW_PARAMETERS, free_cores
    from glasslm.serving.threads import fastest_threads

    cores = free_cores()
    if (os.environ.get("OMP_NUM_THREADS") or cores < 2 or model.embed.device.type != "cpu"
            or model.num_parameters() < ONE_THREAD_BELOW_PARAMETERS):
        return
    best, rates = fastest_threads(model, tokenizer, range(1, cores + 1))
    torch.set_num_threads(best)
    measured = ", ".join(f"{n} -> {rate:.0f} tokens/s" for n, rate in rates.items())
    print(f"threads: {best} (measured for one served stream: {measured}; --threads N to choose)", file=sys.stderr)


COMMAND = Command("serve", serve,
                  "OpenAI-compatible completions server and the explorer page (needs fastapi, uvicorn)",
                  examples=(
                      'glasslm serve --checkpoint runs/shakespeare-char-cpu              # explorer at http://127.0.0.1:8000',
                      'glasslm serve --checkpoint runs/shakespeare-char-cpu --port 8001 --max-batch 8',
                  ))

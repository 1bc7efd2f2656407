"""Where training metrics go: always a JSONL file in the run directory; TensorBoard and W&B on request.

Each metrics record is a flat dict such as
``{"step": 100, "tokens": 76800, "train_loss": 2.31, "lr": 0.001, "grad_norm": 0.8,
"tokens_per_s": 25000.0, "elapsed_s": 3.1}`` plus ``val_loss``/``val_ppl`` at evaluation steps.

Example:
    >>> import json, tempfile
    >>> from pathlib import Path
    >>> run = Path(tempfile.mkdtemp())
    >>> log = JSONLLogger(run / "metrics.jsonl")
    >>> log.log({"step": 1, "train_loss": 4.2})
    >>> log.close()
    >>> read_metrics(run / "metrics.jsonl")
    [{'step': 1, 'train_loss': 4.2}]
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from glasslm.io.checkpoint import CHECKPOINT_PREFIX, POINTER_NAMES

METRICS_FILE = "metrics.jsonl"


class MetricsLogger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JSONLLogger:
    """One JSON object per line, flushed at once so a killed run keeps everything it logged."""

    def __init__(self, path: str | os.PathLike, keep_up_to_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_up_to_step is not None:
            truncate_metrics(self.path, keep_up_to_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh log
        self.file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        # NaN/inf are not JSON; write them as null rather than produce an unreadable line.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL metrics file, skipping a torn last line left by a killed process."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_metrics_file(checkpoint: str | os.PathLike) -> Path | None:
    """The metrics.jsonl of the training run a checkpoint path (as `resolve_checkpoint` takes it) belongs
    to: the path's own for a run directory, its parent's for a ckpt-NNNNNN directory or a latest/best
    pointer; None for a path outside a run (a GGUF file, a Hugging Face directory, a lone checkpoint).

    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> (run / "ckpt-000010").mkdir(); _ = (run / METRICS_FILE).write_text("")
    >>> [run_metrics_file(p) == run / METRICS_FILE for p in (run, run / "ckpt-000010")]
    [True, True]
    >>> _ = (run / "model.gguf").write_bytes(b"GGUF")
    >>> run_metrics_file(run / "model.gguf") is None
    True
    """
    path = Path(checkpoint)
    if path.is_file():
        candidates = [path.parent] if path.name in POINTER_NAMES else []
    else:
        candidates = [path, path.parent] if path.name.startswith(CHECKPOINT_PREFIX) else [path]
    return next((c / METRICS_FILE for c in candidates if (c / METRICS_FILE).is_file()), None)


def truncate_metrics(path: Path, keep_up_to_step: int) -> None:
    """Drop records after `keep_up_to_step` (a resumed run will log those steps again)."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= keep_up_to_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


class TensorBoardLogger:
    """Scalars to TensorBoard event files under run_dir/tensorboard (needs the `tensorboard` package)."""

    def __init__(self, run_dir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard; optional extra

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Metrics to Weights & Biases; offline unless WANDB_MODE says otherwise (needs `wandb`)."""

    def __init__(self, run_dir: str | os.PathLike, config: dict[str, Any], project: str = "glasslm",
                 mode: str | None = None):
        import wandb  # optional extra

        # Read, never set: a logger must not change the environment of the process that made it.
        mode = mode or os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(project=project, dir=str(run_dir), config=config, mode=mode)

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()

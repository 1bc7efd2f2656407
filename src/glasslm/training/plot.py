"""Loss curves of a run as a PNG: train and validation loss against steps and against tokens seen.

Uses matplotlib (a core dependency) through its Figure API, off-screen, so it works without a display
and leaves matplotlib's backend and pyplot's state as they were.

Example:
    >>> import json, tempfile
    >>> from pathlib import Path
    >>> run = Path(tempfile.mkdtemp())
    >>> rows = [{"step": s, "tokens": 768 * s, "train_loss": 4 / s, "val_loss": 4.2 / s} for s in (1, 2, 3)]
    >>> _ = (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> plot_run(run).name
    'loss.png'
"""

from __future__ import annotations

import os
from pathlib import Path

from glasslm.training.loggers import METRICS_FILE, read_metrics


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write a PNG of the run's loss curves (default RUN_DIR/loss.png) and return its path."""
    try:
        # The Figure API draws off-screen without pyplot: no backend switch, no global figure state.
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install matplotlib") from None
    run = Path(run_dir)
    metrics_path = run / METRICS_FILE if run.is_dir() else run
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} does not exist: not a glasslm run directory?")
    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("train_loss") is not None]
    val = [r for r in records if r.get("val_loss") is not None]
    if not train and not val:
        raise ValueError(f"{metrics_path} holds no loss records yet")

    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, x_key, x_label in ((axes[0], "step", "optimizer step"), (axes[1], "tokens", "tokens seen")):
        if train:
            ax.plot([r[x_key] for r in train], [r["train_loss"] for r in train], label="train", lw=1.2)
        if val:
            ax.plot([r[x_key] for r in val], [r["val_loss"] for r in val], "o-", label="validation", ms=3)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy loss (nats/token)")
    axes[0].legend()
    if val:
        best = min(val, key=lambda r: r["val_loss"])
        axes[0].set_title(f"best val loss {best['val_loss']:.4f} at step {best['step']}", fontsize=10)
    axes[1].set_title(run.name if run.is_dir() else run.parent.name, fontsize=10)
    fig.tight_layout()
    target = Path(out) if out is not None else (run if run.is_dir() else run.parent) / "loss.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    return target

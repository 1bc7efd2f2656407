"""Loss curves of a run as a PNG: train and validation loss against steps and against tokens seen,
and, for a post-training run, a second row with what it logged per step: GRPO's mean reward (with
its within-group std as a band), KL to the reference and completion lengths; DPO/SimPO/ORPO's reward
margin and preference accuracy (`TRAINING_SIGNALS`).

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
    >>> rows = [r | {"reward": 0.2 * r["step"], "reward_std": 0.1, "kl": 0.01, "completion_length": 9} for r in rows]
    >>> _ = (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> plot_run(run).name
    'loss.png'
    >>> [title for _, title in signals_logged(read_metrics(run / "metrics.jsonl"))]
    ['mean reward (band: within-group std)', 'KL to the reference', 'completion length (tokens)']
"""

from __future__ import annotations

import os
from pathlib import Path

from glasslm.training.loggers import METRICS_FILE, read_metrics

# What post-training logs per step (metrics.jsonl keys) and the title of its panel, in panel order.
TRAINING_SIGNALS = (("reward", "mean reward (band: within-group std)"), ("kl", "KL to the reference"),
                    ("completion_length", "completion length (tokens)"), ("rewards/margins", "reward margin"),
                    ("rewards/accuracies", "preference accuracy"))


def signals_logged(records: list[dict]) -> list[tuple[str, str]]:
    """The (key, title) of each TRAINING_SIGNALS entry some training record holds."""
    return [(key, title) for key, title in TRAINING_SIGNALS if any(r.get(key) is not None for r in records)]


def _plot_signal(ax, records: list[dict], key: str, title: str) -> None:
    """One post-training signal against the step (training records; held-out ones dotted where logged)."""
    rows = [r for r in records if r.get(key) is not None]
    steps, values = [r["step"] for r in rows], [r[key] for r in rows]
    ax.plot(steps, values, lw=1.2, label="train")
    std_key = {"reward": "reward_std"}.get(key)
    if std_key and all(r.get(std_key) is not None for r in rows):
        ax.fill_between(steps, [v - r[std_key] for v, r in zip(values, rows)],
                        [v + r[std_key] for v, r in zip(values, rows)], alpha=0.2)
    if key == "completion_length" and all(r.get("completion_length_max") is not None for r in rows):
        ax.plot(steps, [r["completion_length_max"] for r in rows], "--", lw=1, label="longest")
        ax.legend(fontsize=8)
    held_out = [r for r in records if r.get(f"val_{key}") is not None]
    if held_out:
        ax.plot([r["step"] for r in held_out], [r[f"val_{key}"] for r in held_out], "o:", ms=3, label="validation")
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)


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

    signals = signals_logged(train)
    fig = Figure(figsize=(11, 7.5 if signals else 4))
    if signals:
        top, bottom = fig.subfigures(2, 1)
        axes = top.subplots(1, 2, sharey=True)
        for ax, (key, title) in zip(bottom.subplots(1, len(signals), squeeze=False)[0], signals):
            _plot_signal(ax, records, key, title)
    else:
        axes = fig.subplots(1, 2, sharey=True)
    for ax, x_key, x_label in ((axes[0], "step", "optimizer step"), (axes[1], "tokens", "tokens seen")):
        if train:
            ax.plot([r[x_key] for r in train], [r["train_loss"] for r in train], label="train", lw=1.2)
        if val:
            ax.plot([r[x_key] for r in val], [r["val_loss"] for r in val], "o-", label="validation", ms=3)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training objective" if signals else "cross-entropy loss (nats/token)")
    axes[0].legend()
    if val:
        best = min(val, key=lambda r: r["val_loss"])
        axes[0].set_title(f"best val loss {best['val_loss']:.4f} at step {best['step']}", fontsize=10)
    axes[1].set_title(run.name if run.is_dir() else run.parent.name, fontsize=10)
    if not signals:  # subfigures lay themselves out
        fig.tight_layout()
    target = Path(out) if out is not None else (run if run.is_dir() else run.parent) / "loss.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    return target

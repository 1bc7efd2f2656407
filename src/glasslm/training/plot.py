"""Loss curves of a run as a PNG: train and validation loss against steps and against tokens seen,
and, for a post-training run, a second row with what it logged per step: GRPO's mean reward (with
its within-group std as a band), KL to the reference and completion lengths; DPO/SimPO/ORPO's rewards
of the chosen and rejected answers (both falling is the collapse a margin alone hides), reward margin
and preference accuracy; a mixture of experts' load-balancing loss and each expert's share of the tokens
(`TRAINING_SIGNALS`). A series of a few records is drawn with a marker at each,
so a run that logged once still shows its point.

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
                    ("completion_length", "completion length (tokens)"),
                    ("rewards/chosen", "rewards of the chosen and rejected answers"),
                    ("rewards/margins", "reward margin"), ("rewards/accuracies", "preference accuracy"),
                    ("moe_balance_loss", "load-balancing loss (k: balanced)"),
                    ("expert_load/0", "each expert's share of the tokens"))
# Drawn in the panel of the first key: (key, its label there).
SAME_PANEL = {"rewards/chosen": ("rewards/rejected", "rejected"), "completion_length": ("completion_length_max", "longest")}
FEW_POINTS = 20  # series with fewer records than this get a marker at each


def signals_logged(records: list[dict]) -> list[tuple[str, str]]:
    """The (key, title) of each TRAINING_SIGNALS entry some training record holds."""
    return [(key, title) for key, title in TRAINING_SIGNALS if any(r.get(key) is not None for r in records)]


def _marker(n: int) -> str | None:
    return "o" if n < FEW_POINTS else None


def _plot_signal(ax, records: list[dict], key: str, title: str) -> None:
    """One post-training signal against the step (training records; held-out ones dotted where logged)."""
    rows = [r for r in records if r.get(key) is not None]
    steps, values = [r["step"] for r in rows], [r[key] for r in rows]
    other = SAME_PANEL.get(key)
    if key == "expert_load/0":  # one line per expert (a mixture of experts' metrics: expert_load/{e})
        _plot_expert_loads(ax, rows, title)
        return
    ax.plot(steps, values, lw=1.2, label="chosen" if key == "rewards/chosen" else "train", marker=_marker(len(rows)), ms=3)
    std_key = {"reward": "reward_std"}.get(key)
    if std_key and all(r.get(std_key) is not None for r in rows):
        ax.fill_between(steps, [v - r[std_key] for v, r in zip(values, rows)],
                        [v + r[std_key] for v, r in zip(values, rows)], alpha=0.2)
    if other and all(r.get(other[0]) is not None for r in rows):
        ax.plot(steps, [r[other[0]] for r in rows], "--", lw=1, label=other[1], marker=_marker(len(rows)), ms=3)
        ax.legend(fontsize=8)
    held_out = [r for r in records if r.get(f"val_{key}") is not None]
    if held_out:
        ax.plot([r["step"] for r in held_out], [r[f"val_{key}"] for r in held_out], "o:", ms=3, label="validation")
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)


def _plot_expert_loads(ax, rows: list[dict], title: str) -> None:
    steps, n = [r["step"] for r in rows], sum(1 for key in rows[0] if key.startswith("expert_load/"))
    for e in range(n):
        ax.plot(steps, [r.get(f"expert_load/{e}") for r in rows], lw=1, label=str(e), marker=_marker(len(rows)), ms=3)
    ax.axhline(1 / n, ls=":", color="gray")  # the balanced share
    if n <= 16:
        ax.legend(fontsize=7, title="expert", title_fontsize=7, ncol=2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write a PNG of the run's loss curves (default RUN_DIR/loss.png) and return its path."""
    run = Path(run_dir)
    metrics_path = run / METRICS_FILE if run.is_dir() else run
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} does not exist: not a glasslm run directory?")
    records = read_metrics(metrics_path)
    if not any(r.get("train_loss") is not None or r.get("val_loss") is not None for r in records):
        raise ValueError(f"{metrics_path} holds no loss records yet")
    fig = draw_run(records, run.name if run.is_dir() else run.parent.name)
    target = Path(out) if out is not None else (run if run.is_dir() else run.parent) / "loss.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    return target


def draw_run(records: list[dict], title: str):
    """The figure `plot_run` saves, from a run's metrics records (`title`: the run's name)."""
    try:
        # The Figure API draws off-screen without pyplot: no backend switch, no global figure state.
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter, MaxNLocator
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install matplotlib") from None
    train = [r for r in records if r.get("train_loss") is not None]
    val = [r for r in records if r.get("val_loss") is not None]
    signals = signals_logged(train)
    fig = Figure(figsize=(11, 7.5 if signals else 4))
    if signals:
        top, bottom = fig.subfigures(2, 1)
        axes = top.subplots(1, 2, sharey=True)
        for ax, (key, signal_title) in zip(bottom.subplots(1, len(signals), squeeze=False)[0], signals):
            _plot_signal(ax, records, key, signal_title)
    else:
        axes = fig.subplots(1, 2, sharey=True)
    for ax, x_key, x_label in ((axes[0], "step", "optimizer step"), (axes[1], "tokens", "tokens seen")):
        if train:
            ax.plot([r[x_key] for r in train], [r["train_loss"] for r in train], label="train", lw=1.2,
                    marker=_marker(len(train)), ms=3)
        if val:
            ax.plot([r[x_key] for r in val], [r["val_loss"] for r in val], "o-", label="validation", ms=3)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    # Millions of tokens in full digits ran into one another: "4M", "8M", at most five ticks.
    axes[1].xaxis.set_major_formatter(EngFormatter(sep=""))
    axes[1].xaxis.set_major_locator(MaxNLocator(nbins=5))
    axes[0].set_ylabel("training objective" if signals else "cross-entropy loss (nats/token)")
    axes[0].legend()
    if val:
        best = min(val, key=lambda r: r["val_loss"])
        axes[0].set_title(f"best val loss {best['val_loss']:.4f} at step {best['step']}", fontsize=10)
    axes[1].set_title(title, fontsize=10)
    if not signals:  # subfigures lay themselves out
        fig.tight_layout()
    return fig

"""`glasslm plot RUN_DIR`: a PNG of a run's train/val loss against steps and tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from glasslm.cli.command import Command


@dataclass
class PlotConfig:
    """the plot"""

    run_dir: str = field(metadata={"positional": True})  # run directory holding metrics.jsonl
    out: str | None = None  # PNG path; none: RUN_DIR/loss.png


def plot(config: PlotConfig) -> int:
    from glasslm.training.plot import plot_run

    print(f"wrote {plot_run(config.run_dir, config.out)}")
    return 0


COMMAND = Command("plot", plot, "PNG of train/val loss against steps and tokens of a run",
                  examples=(
                      'glasslm plot runs/shakespeare-char-cpu',
                  ))

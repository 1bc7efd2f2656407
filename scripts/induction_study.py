"""Train the induction-head study's model and draw docs/induction.md's figures and numbers.

    python scripts/induction_study.py                 # the preset's recipe (1500 steps; minutes on 2 cores)
    python scripts/induction_study.py --steps 300     # a shorter run
    python scripts/induction_study.py --figures docs/figures   # refresh the page's own figures

Writes induction_loss.png, induction_scores.png, induction_patching.png and induction_study.json
(every number the page quotes) to --figures DIR (default runs/induction-figures), so a run never
rewrites the tracked docs/figures unless asked to.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from glasslm.interp.induction import run_induction_study, save_study_model
from glasslm.locations import check_output_dir

FIGURES = Path("runs") / "induction-figures"  # relative to the working directory, as glasslm's --out paths


def save(fig: Figure, folder: Path, name: str) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(folder / name, dpi=110)


def plot_losses(history: list[dict], folder: Path) -> None:
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["first_half_loss"] for h in history], label="first half (random)")
    ax.plot(steps, [h["repeated_half_loss"] for h in history], label="repeated half")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.legend()
    save(fig, folder, "induction_loss.png")


def plot_scores(history: list[dict], folder: Path) -> None:
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    steps = [h["step"] for h in history]
    n_layers, n_heads = len(history[0]["induction_scores"]), len(history[0]["induction_scores"][0])
    for layer in range(n_layers):
        for head in range(n_heads):
            ax.plot(steps, [h["induction_scores"][layer][head] for h in history], label=f"L{layer}H{head}",
                    linestyle="-" if layer else ":")
    ax.set_xlabel("step")
    ax.set_ylabel("induction score")
    ax.legend(ncol=2, fontsize=7)
    save(fig, folder, "induction_scores.png")


def plot_patching(grid: list[list[float]], folder: Path) -> None:
    fig = Figure(figsize=(4.5, 2.8))
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="RdBu", vmin=-1, vmax=1)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(len(grid[0])))
    ax.set_yticks(range(len(grid)))
    for layer, row in enumerate(grid):
        for head, value in enumerate(row):
            ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="fraction of log-prob restored")
    save(fig, folder, "induction_patching.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's recipe)")
    parser.add_argument("--record-every", type=int, default=50)
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="also save the trained model as a checkpoint (glasslm serve --checkpoint DIR opens it)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--figures", metavar="DIR", type=Path, default=FIGURES,
                        help=f"where the figures and numbers go (default {FIGURES}; docs/figures: the page's own)")
    args = parser.parse_args()
    if args.out:
        try:
            check_output_dir(args.out, args.overwrite, what="study model")  # before training, not after it
        except ValueError as err:
            parser.error(str(err))
    torch.set_num_threads(1)  # a model this small trains fastest on one thread (no contention between threads)
    def progress(entry: dict) -> None:
        print(f"step {entry['step']}: first half {entry['first_half_loss']:.3f}, repeated half "
              f"{entry['repeated_half_loss']:.3f}, best induction {max(map(max, entry['induction_scores'])):.3f}",
              flush=True)

    study = run_induction_study(steps=args.steps, record_every=args.record_every, on_record=progress)
    args.figures.mkdir(parents=True, exist_ok=True)
    plot_losses(study["history"], args.figures)
    plot_scores(study["history"], args.figures)
    plot_patching(study["head_patching"], args.figures)
    numbers = {key: study[key] for key in ("history", "previous_token_scores", "head_patching")}
    (args.figures / "induction_study.json").write_text(json.dumps(numbers, indent=1))
    print(f"figures and numbers in {args.figures}")
    if args.out:
        save_study_model(study["model"], args.out, study["history"], overwrite=args.overwrite)
        print(f"saved the model to {args.out}: glasslm serve --checkpoint {args.out}")
    last = study["history"][-1]
    print(f"step {last['step']}: first-half loss {last['first_half_loss']:.3f}, repeated-half loss "
          f"{last['repeated_half_loss']:.3f}, best induction score {max(map(max, last['induction_scores'])):.3f}")


if __name__ == "__main__":
    main()

"""`glasslm plot`'s figure (issue 47): the panels a DPO run needs (chosen and rejected rewards, not only
margin and accuracy), a tokens-seen axis whose labels can be read, and no empty panel for a run that
logged a single record (a GRPO run shorter than its log interval)."""

from __future__ import annotations

import json

import pytest

from glasslm.cli import main
from glasslm.training.plot import draw_run


def _records(steps, tokens_per_step=24_576, **signals):
    return [{"step": s, "tokens": s * tokens_per_step, "train_loss": 0.7 / s,
             **{key: value(s) for key, value in signals.items()}} for s in steps]


def _gaps(ax) -> tuple[list[str], list[float]]:
    """The x tick labels drawn (inside the axis's range) and the pixels between neighbours."""
    low, high = ax.get_xlim()
    labels = [label for tick, label in zip(ax.get_xticks(), ax.get_xticklabels())
              if low <= tick <= high and label.get_text()]
    boxes = [label.get_window_extent() for label in labels]
    return [label.get_text() for label in labels], [b.x0 - a.x1 for a, b in zip(boxes, boxes[1:])]


def test_a_dpo_run_draws_the_chosen_and_rejected_rewards():
    records = _records(range(10, 1001, 10), **{"rewards/chosen": lambda s: -s / 100, "rewards/rejected": lambda s: -s / 40,
                                               "rewards/margins": lambda s: 3 * s / 200, "rewards/accuracies": lambda s: 1.0})
    fig = draw_run(records, "dpo")
    titles = {ax.get_title(): ax for ax in fig.get_axes()}
    rewards = next(ax for title, ax in titles.items() if "chosen" in title)
    drawn = {line.get_label(): list(line.get_ydata()) for line in rewards.get_lines()}
    assert drawn["chosen"][-1] == pytest.approx(-10.0) and drawn["rejected"][-1] == pytest.approx(-25.0)
    assert {"reward margin", "preference accuracy"} <= set(titles)


@pytest.mark.parametrize("tokens_per_step", [914, 8 * 2048])  # the demo model's DPO run; 16.4M tokens
def test_the_tokens_seen_axis_labels_are_short_and_apart(tokens_per_step):
    """Issue 47: the axis read "200000400000600000800000"; matplotlib's plain labels were 6 and 7 digits
    19-24 px apart on the demo model's DPO run (or small numbers times an offset "1e7" printed apart)."""
    fig = draw_run(_records(range(10, 1001, 10), tokens_per_step=tokens_per_step), "run")
    fig.canvas.draw()
    tokens_axis = next(ax for ax in fig.get_axes() if ax.get_xlabel() == "tokens seen")
    texts, gaps = _gaps(tokens_axis)
    assert len(texts) >= 3 and all(len(text) <= 5 for text in texts), texts  # "400k", "1.2M"
    assert tokens_axis.xaxis.get_offset_text().get_text() == ""
    assert min(gaps) >= 30, (texts, gaps)  # pixels at plot's 110 dpi: a gap of several characters


def test_a_run_with_one_record_draws_a_point_in_every_panel(tmp_path):
    records = _records([6], reward=lambda s: 0.5, reward_std=lambda s: 0.1, kl=lambda s: 0.01,
                       completion_length=lambda s: 9.0, completion_length_max=lambda s: 12.0)
    fig = draw_run(records, "grpo")
    for ax in fig.get_axes():
        lines = [line for line in ax.get_lines() if len(line.get_xdata())]
        assert lines, ax.get_title()
        assert all(len(line.get_xdata()) > 1 or line.get_marker() not in (None, "None", "") for line in lines), \
            ax.get_title()  # a single point is drawn as a marker, not as a line of no length
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(tmp_path)]) == 0 and (tmp_path / "loss.png").stat().st_size > 0


def test_a_mixture_of_experts_run_draws_its_balance_loss_and_each_experts_share():
    shares = {f"expert_load/{e}": (lambda s, e=e: 0.25 + (e - 1.5) * 0.1 / s) for e in range(4)}
    records = _records(range(10, 101, 10), moe_balance_loss=lambda s: 2 + 1 / s, **shares)
    fig = draw_run(records, "moe")
    titles = {ax.get_title(): ax for ax in fig.get_axes()}
    assert "load-balancing loss (k: balanced)" in titles and "moe" in titles  # (the run's name kept its place)
    loads = titles["each expert's share of the tokens"]
    drawn = {line.get_label(): list(line.get_ydata()) for line in loads.get_lines()}
    assert [drawn[str(e)][0] for e in range(4)] == pytest.approx([0.235, 0.245, 0.255, 0.265])

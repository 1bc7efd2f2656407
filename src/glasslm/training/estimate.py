"""How long a run will take, measured before it starts, and the refusal of one that would take too long.

A preset's recipe can be meant for a GPU cluster: gpt2-small's (nanoGPT's) is 600,000 steps of 40
micro-batches, years on a laptop CPU, and its first step alone takes minutes there. So the estimate
times single micro-batches (forward and backward on the run's model, batch and device) before the
first step, then undoes them (gradients cleared, random generators restored): the run itself is
unchanged, and a refused run has written nothing. Under a limit, one row is timed first and a run
already far past the limit is refused from it (seconds, not the minutes of a whole micro-batch).

    estimate = steps left x micro-batches per step x seconds per micro-batch
               + evaluations (forward only: about a third of a micro-batch each)

The optimizer's own work is left out, so a run with few micro-batches per step takes a little longer.

Example:
    >>> estimate = TrainingEstimate(steps=600_000, micro_batches=40, micro_batch_s=2.5, rows=12, tokens_per_row=1024,
    ...                             device="cpu", evaluations=601, eval_batches=200)
    >>> estimate.describe()
    'about 1.9 years: 600,000 steps x 40 micro-batches x 2.50 s (one micro-batch of 12 x 1024 tokens, timed on cpu)'
    >>> format_duration(95), format_duration(3 * 3600 + 60), format_duration(DAY_S)
    ('1.6 minutes', '3 hours', '1 day')
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from glasslm.training.parts import TrainingParts
from glasslm.training.step import autocast_context

DAY_S = 24 * 3600.0
# Micro-batches are timed until this much time has passed (at most PROBE_RUNS): a fast one is then
# the fastest warm one (a busy machine's stalls only ever add time); a slow first one is the estimate.
PROBE_S = 0.5
PROBE_RUNS = 5
# A one-row timing scaled by the rows refuses a run only when this far past the limit: rows do not
# scale exactly linearly (a single row uses the cores less well), and a run near the limit deserves
# the whole micro-batch's figure.
QUICK_MARGIN = 2.0
FORWARD_SHARE = 1 / 3  # a forward pass costs about a third of forward + backward


@dataclass(frozen=True)
class TrainingEstimate:
    """The measured time of one micro-batch, and what the rest of the run adds up to."""

    steps: int  # optimizer steps left
    micro_batches: int  # per step (grad_accum_steps)
    micro_batch_s: float  # forward + backward of one micro-batch, as timed
    rows: int  # sequences in a micro-batch
    tokens_per_row: float
    device: str
    evaluations: int  # validation runs left
    eval_batches: int  # batches per validation run
    timed_rows: int | None = None  # rows actually timed when fewer than `rows` (then scaled up); None: all

    @property
    def seconds(self) -> float:
        training = self.steps * self.micro_batches * self.micro_batch_s
        return training + self.evaluations * self.eval_batches * self.micro_batch_s * FORWARD_SHARE

    def describe(self) -> str:
        """'about T: steps x micro-batches x seconds (what was timed)'."""
        batches = f"{self.micro_batches:,} micro-batch" + ("es" if self.micro_batches != 1 else "")
        timed = (f"one micro-batch of {self.rows} x {self.tokens_per_row:.0f} tokens, timed on {self.device}"
                 if self.timed_rows is None else
                 f"one micro-batch of {self.rows} x {self.tokens_per_row:.0f} tokens: {self.timed_rows} row(s) timed "
                 f"on {self.device}, scaled by the rows")
        return f"about {format_duration(self.seconds)}: {self.steps:,} steps x {batches} x {self.micro_batch_s:.2f} s ({timed})"


class TrainingTooLong(RuntimeError):
    """The estimate is over the limit the caller set (`train(..., refuse_longer_than_s=...)`);
    raised before anything is written."""

    def __init__(self, estimate: TrainingEstimate, limit_s: float):
        self.estimate, self.limit_s = estimate, limit_s
        super().__init__(f"training would take {estimate.describe()}, more than the limit of "
                         f"{format_duration(limit_s)}; nothing was written. Lower max_steps or grad_accum_steps, "
                         "use a smaller model, or raise refuse_longer_than_s (None: no limit)")


def format_duration(seconds: float) -> str:
    """A duration in the largest unit that leaves at least 1 (seconds up to years), one decimal."""
    for unit, size in (("year", 365 * DAY_S), ("day", DAY_S), ("hour", 3600.0), ("minute", 60.0), ("second", 1.0)):
        if seconds >= size or unit == "second":
            count = f"{seconds / size:.1f}".removesuffix(".0")
            return f"{count} {unit}" + ("" if count == "1" else "s")
    raise AssertionError("unreachable")


def estimate_training(parts: TrainingParts, refuse_above_s: float | None = None) -> TrainingEstimate:
    """Time the run's first micro-batch (see the module docstring) and add up the steps left.

    With a limit, one row is timed first: a gpt2-small micro-batch takes minutes on a CPU and one of
    its rows seconds, so a run whose one-row figure, scaled by the rows, is already past QUICK_MARGIN
    times the limit is refused from that figure, without waiting for the whole micro-batch."""
    cfg = parts.cfg
    steps = max(cfg.max_steps - parts.point.step, 0)
    evaluations = (steps // cfg.eval_interval if cfg.eval_interval else 0) + 1 if parts.val_source else 0

    def estimate(micro_batch_s: float, timed_rows: int | None) -> TrainingEstimate:
        return TrainingEstimate(steps, cfg.grad_accum_steps, micro_batch_s, cfg.batch_size,
                                parts.train_source.tokens_per_row(), str(parts.device), evaluations, cfg.eval_iters,
                                timed_rows)

    if refuse_above_s is not None and cfg.batch_size > 1:
        quick = estimate(time_micro_batch(parts, rows=1) * cfg.batch_size, timed_rows=1)
        if quick.seconds > QUICK_MARGIN * refuse_above_s:
            return quick
    return estimate(time_micro_batch(parts), None)


def time_micro_batch(parts: TrainingParts, rows: int | None = None) -> float:
    """Seconds of one forward + backward of the first step's first micro-batch (its first `rows`
    rows where given); afterwards the gradients are cleared and the generators it drew from are as
    before, so the run is unchanged."""
    cfg = parts.cfg
    states = (parts.batch_rng.get_state(), torch.get_rng_state())
    cuda = torch.device(parts.device).type == "cuda"
    cuda_state = torch.cuda.get_rng_state(parts.device) if cuda else None
    x, y = parts.next_batch()
    xc, yc = x.tensor_split(cfg.grad_accum_steps)[0][:rows], y.tensor_split(cfg.grad_accum_steps)[0][:rows]
    timings: list[float] = []
    least = 2 if cfg.compile else 1  # a compiled model's first call is mostly compilation
    while len(timings) < least or (sum(timings) < PROBE_S and len(timings) < PROBE_RUNS):
        started = time.perf_counter()
        with autocast_context(cfg, parts.device):
            loss = parts.objective(parts.step_model, xc, yc)[0]  # (b / accum, t) -> ()
        loss.backward()
        if cuda:
            torch.cuda.synchronize(parts.device)
        timings.append(time.perf_counter() - started)
    parts.model.zero_grad(set_to_none=True)
    parts.batch_rng.set_state(states[0])
    torch.set_rng_state(states[1])
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, parts.device)
    return min(timings[1:]) if len(timings) > 1 else timings[0]

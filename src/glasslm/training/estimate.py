"""How long a run will take, measured before it starts, and the refusal of one that would take too long.

A preset's recipe can be meant for a GPU cluster: gpt2-small's (nanoGPT's) is 600,000 steps of 40
micro-batches, years on a laptop CPU, and its first step alone takes minutes there. So the estimate
times micro-batches (forward and backward on the run's model, batch, device and threads: a warm-up,
then the median of a second's worth, `probe`) before the first step, then undoes them (gradients
cleared, random generators restored): the run itself is unchanged, and a refused run has written
nothing. Under a limit, one row is timed first and a run
already far past the limit is refused from it (seconds, not the minutes of a whole micro-batch).

    estimate = steps left x (micro-batches per step x seconds per micro-batch + seconds per optimizer step)
               + evaluations (forward only: about a third of a micro-batch each)

The optimizer step is timed too (on made-up gradients, the weights and the optimizer's state put
back): Muon's orthogonalization costs half a micro-batch of the demo model.

Example:
    >>> estimate = TrainingEstimate(steps=600_000, micro_batches=40, micro_batch_s=2.5, rows=12, tokens_per_row=1024,
    ...                             device="cpu", evaluations=601, eval_batches=200, optimizer_s=0.4)
    >>> estimate.describe()
    'about 1.9 years: 600,000 steps x (40 micro-batches x 2.50 s + 0.40 s optimizer step) (one micro-batch of 12 x 1024 tokens, timed on cpu)'
    >>> format_duration(95), format_duration(3 * 3600 + 60), format_duration(DAY_S)
    ('1.6 minutes', '3 hours', '1 day')
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from glasslm.training.optim import clip_grad_norm
from glasslm.training.parts import TrainingParts
from glasslm.training.step import autocast_context

DAY_S = 24 * 3600.0
# After a warm-up, micro-batches are timed until this much time has passed (at least one, at most
# PROBE_RUNS) and their median is the figure (`probe`); a warm-up this long is the figure itself.
PROBE_S = 1.0
PROBE_RUNS = 25
WARMUP_IS_ENOUGH_S = 10.0
# The optimizer step is timed for up to this many trainable parameters (beyond, its weights and
# state would be copied for the timing; at that size AdamW's share of a step is small).
OPTIMIZER_TIMED_UP_TO = 200_000_000
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
    optimizer_s: float = 0.0  # gradient clipping + optimizer step, as timed (0: not timed)

    @property
    def seconds(self) -> float:
        training = self.steps * (self.micro_batches * self.micro_batch_s + self.optimizer_s)
        return training + self.evaluations * self.eval_batches * self.micro_batch_s * FORWARD_SHARE

    def describe(self) -> str:
        """'about T: steps x micro-batches x seconds (what was timed)'."""
        batches = f"{self.micro_batches:,} micro-batch" + ("es" if self.micro_batches != 1 else "")
        timed = (f"one micro-batch of {self.rows} x {self.tokens_per_row:.0f} tokens, timed on {self.device}"
                 if self.timed_rows is None else
                 f"one micro-batch of {self.rows} x {self.tokens_per_row:.0f} tokens: {self.timed_rows} row(s) timed "
                 f"on {self.device}, scaled by the rows")
        step = f"{batches} x {self.micro_batch_s:.2f} s"
        if self.optimizer_s:
            step = f"({step} + {self.optimizer_s:.2f} s optimizer step)"
        return f"about {format_duration(self.seconds)}: {self.steps:,} steps x {step} ({timed})"


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

    # Fine-tuning evaluates every held-out conversation once, however many eval_iters say (a batch
    # source of one's own without the count is taken to give eval_iters batches).
    count = getattr(parts.val_source, "eval_batch_count", None)
    # (pretraining's windows come in draws of the step's global batch: grad_accum_steps batches each)
    eval_batches = count(cfg.batch_size, cfg.eval_iters, cfg.batch_size * cfg.grad_accum_steps) \
        if count is not None else cfg.eval_iters

    def estimate(micro_batch_s: float, timed_rows: int | None, optimizer_s: float = 0.0) -> TrainingEstimate:
        return TrainingEstimate(steps, cfg.grad_accum_steps, micro_batch_s, cfg.batch_size,
                                parts.train_source.tokens_per_row(), str(parts.device), evaluations, eval_batches,
                                timed_rows, optimizer_s)

    if refuse_above_s is not None and cfg.batch_size > 1:
        quick = estimate(time_micro_batch(parts, rows=1) * cfg.batch_size, timed_rows=1)  # optimizer left out
        if quick.seconds > QUICK_MARGIN * refuse_above_s:
            return quick
    micro_batch_s = time_micro_batch(parts)
    return estimate(micro_batch_s, None, time_optimizer_step(parts))


def time_micro_batch(parts: TrainingParts, rows: int | None = None) -> float:
    """Seconds of one forward + backward of the first step's first micro-batch (its first `rows`
    rows where given), on the threads the run will use, after a warm-up (`probe`); afterwards the
    gradients are cleared and the generators it drew from are as before, so the run is unchanged."""
    cfg = parts.cfg
    states = (parts.batch_rng.get_state(), torch.get_rng_state())
    cuda = torch.device(parts.device).type == "cuda"
    cuda_state = torch.cuda.get_rng_state(parts.device) if cuda else None
    x, y = parts.next_batch()
    if rows is not None:  # a drawn row may be several tensor rows (a preference pair: two)
        rows *= x.shape[0] // (cfg.batch_size * cfg.grad_accum_steps)
    xc, yc = x.tensor_split(cfg.grad_accum_steps)[0][:rows], y.tensor_split(cfg.grad_accum_steps)[0][:rows]

    def forward_backward() -> float:
        started = time.perf_counter()
        with autocast_context(cfg, parts.device):
            loss = parts.objective(parts.step_model, xc, yc)[0]  # (b / accum, t) -> ()
        loss.backward()
        if cuda:
            torch.cuda.synchronize(parts.device)
        return time.perf_counter() - started

    seconds = probe(forward_backward, always_warm=cfg.compile)  # a compiled model's first call is mostly compilation
    parts.model.zero_grad(set_to_none=True)
    parts.batch_rng.set_state(states[0])
    torch.set_rng_state(states[1])
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, parts.device)
    return seconds


def time_optimizer_step(parts: TrainingParts) -> float:
    """Seconds of one gradient clipping + optimizer step (a warm-up step first: an optimizer makes
    its state on its first step), on made-up gradients (a step's time does not depend on their
    values), then the weights and the optimizer's state put back and the gradients cleared. 0 when
    the trainable weights are over OPTIMIZER_TIMED_UP_TO (copying them and the state would cost more
    memory than the share of the step is worth) or a loss scaler steps the optimizer."""
    trainable = [p for p in parts.model.parameters() if p.requires_grad]
    if not trainable or parts.scaler is not None or sum(p.numel() for p in trainable) > OPTIMIZER_TIMED_UP_TO:
        return 0.0
    generator = torch.Generator(trainable[0].device).manual_seed(0)
    for p in trainable:
        p.grad = torch.empty_like(p).normal_(generator=generator)
    weights = [p.detach().clone() for p in trainable]
    state = copy.deepcopy(parts.optimizer.state_dict())
    max_norm = parts.cfg.grad_clip if parts.cfg.grad_clip > 0 else math.inf
    cuda = torch.device(parts.device).type == "cuda"

    def step() -> float:
        started = time.perf_counter()
        clip_grad_norm(trainable, max_norm)
        parts.optimizer.step()
        if cuda:
            torch.cuda.synchronize(parts.device)
        return time.perf_counter() - started

    try:
        return probe(step)
    finally:
        with torch.no_grad():
            for p, weight in zip(trainable, weights):
                p.copy_(weight)
        parts.optimizer.load_state_dict(state)
        parts.model.zero_grad(set_to_none=True)


def probe(run: Callable[[], float], always_warm: bool = False) -> float:
    """The typical seconds of `run()` (which times itself): one untimed warm-up call, then the
    median of calls until PROBE_S have passed (at least one, at most PROBE_RUNS).

    The warm-up takes what only the first call pays (memory for the activations, kernels made for
    these shapes, a compiled model's compilation). The median, not the fastest: on a loaded machine
    a step waits its turn for a core, and the fastest call is the rare one that did not wait (the
    demo model's fine-tuning micro-batch on 2 threads at a load average of 6.6 on 2 cores took from
    0.6 s to 8.5 s; on the one thread `glasslm finetune` now chooses there, 0.09-0.13 s). A warm-up
    over WARMUP_IS_ENOUGH_S is the figure (unless `always_warm`): at that length a second call would
    double a long wait to correct its first-call share, which is small.

    Example:
        >>> calls = iter([5.0, 0.2, 0.6, 0.21])
        >>> probe(lambda: next(calls))  # the 5 s warm-up is left out, the 0.6 s stall outvoted
        0.21
    """
    warmup = run()
    if warmup >= WARMUP_IS_ENOUGH_S and not always_warm:
        return warmup
    timings: list[float] = []
    while not timings or (sum(timings) < PROBE_S and len(timings) < PROBE_RUNS):
        timings.append(run())
    return statistics.median(timings)

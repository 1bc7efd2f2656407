"""Where a run's batches come from: the seam between the training loop and its data.

A batch source draws one *global* batch of (inputs, labels) rows from a generator (the loop's
batch sampler, saved in every checkpoint, so a resumed run draws what the uninterrupted run drew)
and gives the validation batches. Labels equal to IGNORE_INDEX are left out of the loss. Under
data parallelism each process asks for its `share` (index, count) of the rows: every process
draws the whole global batch's random numbers, so their generators stay in step, and builds (from
a token file: reads) only its own rows, the ones `Tensor.tensor_split(count)[index]` of the whole
batch would give (`share_rows`).

- `WindowBatches` (pretraining): random contiguous windows of a 1-D token stream.
- `SFTBatches` (supervised fine-tuning): whole conversations (glasslm.data.sft), right-padded to
  the longest row, labels only on the assistant's tokens; validation runs over every held-out
  conversation once, in a fixed order, the loss a mean over their assistant tokens.
- `PreferenceBatches` (preference tuning, glasslm.training.dpo): pairs of conversations, each
  pair's chosen and rejected sides in adjacent rows (2i, 2i + 1), so every split of a batch into
  even slices (processes, micro-batches) keeps the pairs whole.
- `ProblemBatches` (GRPO, glasslm.training.grpo): problem numbers; the objective samples the
  completions and scores them.

Example:
    >>> import torch
    >>> from glasslm.data.sft import IGNORE_INDEX, SFTExample
    >>> source = SFTBatches([SFTExample([5, 6, 7], [IGNORE_INDEX, 7, IGNORE_INDEX])], context_length=8)
    >>> x, y = source.draw(2, torch.Generator().manual_seed(0))
    >>> x.tolist(), y.tolist()
    ([[5, 6, 7], [5, 6, 7]], [[-100, 7, -100], [-100, 7, -100]])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from jaxtyping import Int
from torch import Tensor

from glasslm.data import read_windows, window_starts
from glasslm.data.preferences import PreferencePair
from glasslm.data.problems import EncodedProblem
from glasslm.data.sft import IGNORE_INDEX, SFTExample, padded_batch, padded_width

WHOLE = (0, 1)  # a share (index, count): all the rows


def share_rows(rows: int, share: tuple[int, int]) -> slice:
    """The rows of `share` = (index, count) of `rows` rows: the ones tensor_split(count)[index] takes.

    >>> [share_rows(7, (i, 3)) for i in range(3)]
    [slice(0, 3, None), slice(3, 5, None), slice(5, 7, None)]
    """
    index, count = share
    size, extra = divmod(rows, count)
    start = index * size + min(index, extra)
    return slice(start, start + size + (index < extra))


class BatchSource(Protocol):
    """What the training loop needs of its data."""

    def check(self, name: str) -> None:
        """Raise a ValueError (naming `name`: training / validation) if there is too little data."""

    def draw(self, rows: int, generator: torch.Generator,
             share: tuple[int, int] = WHOLE) -> tuple[Int[Tensor, "r t"], Int[Tensor, "r t"]]:
        """`share` of one global batch of `rows` rows: (inputs, labels)."""

    def eval_batches(self, rows: int, iters: int, generator: torch.Generator, per_draw: int | None = None,
                     share: tuple[int, int] = WHOLE) -> Iterator[tuple[Tensor, Tensor, float]]:
        """Validation batches (inputs, labels, weight) of `rows` rows, `share` of each; the validation
        loss is their weighted mean (a batch's weight is the whole batch's). A source that draws at
        random draws `per_draw` rows at a time (a multiple of `rows`: the step's global batch) and
        splits each draw into batches, so the rows validated depend on the global batch alone, not
        on how processes and accumulation split it."""

    def eval_batch_count(self, rows: int, iters: int, per_draw: int | None = None) -> int:
        """How many batches `eval_batches(rows, iters, ..., per_draw)` gives (for the training-time estimate)."""

    def tokens_per_row(self) -> float:
        """Positions per row, on average (for tokens/s)."""


class WindowBatches:
    """Random windows of `context_length` tokens from a 1-D stream (anything `get_batch` indexes)."""

    def __init__(self, tokens: Tensor, context_length: int):
        self.tokens, self.context_length = tokens, context_length

    def check(self, name: str) -> None:
        if len(self.tokens) <= self.context_length:
            raise ValueError(f"{name} data has {len(self.tokens)} tokens; need more than "
                             f"context_length={self.context_length}")

    def draw(self, rows: int, generator: torch.Generator, share: tuple[int, int] = WHOLE) -> tuple[Tensor, Tensor]:
        starts = window_starts(len(self.tokens), rows, self.context_length, generator)  # (rows,)
        return read_windows(self.tokens, starts[share_rows(rows, share)], self.context_length)  # each (share, context)

    def eval_batches(self, rows: int, iters: int, generator: torch.Generator, per_draw: int | None = None,
                     share: tuple[int, int] = WHOLE) -> Iterator[tuple[Tensor, Tensor, float]]:
        for _ in range(iters):  # every batch holds rows * context positions: equal weights
            starts = window_starts(len(self.tokens), per_draw or rows, self.context_length, generator)
            for batch in starts.split(rows):  # (rows,) each
                yield *read_windows(self.tokens, batch[share_rows(len(batch), share)], self.context_length), 1.0

    def eval_batch_count(self, rows: int, iters: int, per_draw: int | None = None) -> int:
        return iters * -(-(per_draw or rows) // rows)

    def tokens_per_row(self) -> float:
        return float(self.context_length)


class SFTBatches:
    """Conversations drawn uniformly at random (with replacement) from the generator, padded per batch."""

    def __init__(self, examples: Sequence[SFTExample], context_length: int, pad_id: int = 0):
        self.examples, self.context_length, self.pad_id = list(examples), context_length, pad_id

    def __len__(self) -> int:
        return len(self.examples)

    def check(self, name: str) -> None:
        if not self.examples:
            raise ValueError(f"{name} data holds no conversations")
        if not any(self._trained(e) for e in self.examples):
            raise ValueError(f"{name} data has no assistant token within context_length={self.context_length}")

    def _trained(self, example: SFTExample) -> int:
        # padded_batch drops the last kept label of a cut example (its target is never seen)
        kept = example.labels[:min(len(example.ids), self.context_length) - 1]
        return sum(label != IGNORE_INDEX for label in kept)

    def draw(self, rows: int, generator: torch.Generator, share: tuple[int, int] = WHOLE) -> tuple[Tensor, Tensor]:
        """`share` of the rows, padded as the whole batch is (the same shapes as one process's)."""
        chosen = [self.examples[i] for i in torch.randint(len(self.examples), (rows,), generator=generator).tolist()]
        width = padded_width(chosen, self.context_length)
        return padded_batch(chosen[share_rows(rows, share)], self.context_length, self.pad_id, width)  # (share, width)

    def eval_batches(self, rows: int, iters: int, generator: torch.Generator, per_draw: int | None = None,
                     share: tuple[int, int] = WHOLE) -> Iterator[tuple[Tensor, Tensor, float]]:
        """Every example once (`iters` and `generator` are not needed), each batch weighted by its
        trained tokens, so the loss is the mean over all held-out assistant tokens."""
        for start in range(0, len(self.examples), rows):
            x, y = padded_batch(self.examples[start:start + rows], self.context_length, self.pad_id)
            keep = share_rows(len(x), share)  # the held-out set is small: built whole for the weight
            yield x[keep], y[keep], float((y != IGNORE_INDEX).sum())

    def eval_batch_count(self, rows: int, iters: int, per_draw: int | None = None) -> int:
        return -(-len(self.examples) // rows)

    def tokens_per_row(self) -> float:
        return sum(min(len(e.ids), self.context_length) for e in self.examples) / max(1, len(self.examples))


class PreferenceBatches:
    """Preference pairs drawn uniformly at random (with replacement); `rows` pairs give 2 x rows rows,
    chosen and rejected interleaved, right-padded per batch, labels on the completions only."""

    def __init__(self, pairs: Sequence[PreferencePair], context_length: int, pad_id: int = 0):
        self.pairs, self.context_length, self.pad_id = list(pairs), context_length, pad_id
        self.sides = SFTBatches([e for p in self.pairs for e in (p.chosen, p.rejected)], context_length, pad_id)

    def __len__(self) -> int:
        return len(self.pairs)

    def check(self, name: str) -> None:
        if not self.pairs:
            raise ValueError(f"{name} data holds no preference pairs")
        trained = self.sides._trained
        cut = [i for i, p in enumerate(self.pairs) if not (trained(p.chosen) and trained(p.rejected))]
        if cut:
            raise ValueError(f"{name} data: {len(cut)} of {len(self.pairs)} pairs (the first: pair {cut[0] + 1}) keep "
                             f"no completion token within context_length={self.context_length}; shorten their prompts")

    def _batch(self, pairs: Sequence[PreferencePair], width: int | None = None) -> tuple[Tensor, Tensor]:
        return padded_batch([e for p in pairs for e in (p.chosen, p.rejected)], self.context_length,
                            self.pad_id, width)  # (2 * pairs, width)

    def draw(self, rows: int, generator: torch.Generator, share: tuple[int, int] = WHOLE) -> tuple[Tensor, Tensor]:
        """`share` of the `rows` pairs (2 rows each), padded as the whole batch is."""
        chosen = [self.pairs[i] for i in torch.randint(len(self.pairs), (rows,), generator=generator).tolist()]
        width = padded_width([e for p in chosen for e in (p.chosen, p.rejected)], self.context_length)
        return self._batch(chosen[share_rows(rows, share)], width)

    def eval_batches(self, rows: int, iters: int, generator: torch.Generator, per_draw: int | None = None,
                     share: tuple[int, int] = WHOLE) -> Iterator[tuple[Tensor, Tensor, float]]:
        """Every pair once, each batch weighted by its pairs (the loss is a mean over pairs)."""
        for start in range(0, len(self.pairs), rows):
            batch = self.pairs[start:start + rows]
            x, y = self._batch(batch)
            keep = share_rows(len(x), share)
            yield x[keep], y[keep], float(len(batch))

    def eval_batch_count(self, rows: int, iters: int, per_draw: int | None = None) -> int:
        return -(-len(self.pairs) // rows)

    def tokens_per_row(self) -> float:
        """Positions per drawn row, i.e. per pair (both sides)."""
        return 2 * self.sides.tokens_per_row()


class ProblemBatches:
    """Problems for GRPO (glasslm.training.grpo), drawn uniformly at random (with replacement): a batch
    is `rows` problem numbers, (rows, 1) as both inputs and labels; the objective samples the
    completions. Each prompt must leave room for `max_new_tokens` within the context."""

    def __init__(self, problems: Sequence[EncodedProblem], context_length: int, max_new_tokens: int):
        self.problems, self.context_length, self.max_new_tokens = list(problems), context_length, max_new_tokens

    def __len__(self) -> int:
        return len(self.problems)

    def check(self, name: str) -> None:
        if not self.problems:
            raise ValueError(f"{name} data holds no problems")
        room = self.context_length - self.max_new_tokens
        long = [i for i, p in enumerate(self.problems) if len(p.prompt_ids) > room]
        if long:
            raise ValueError(f"{name} data: {len(long)} of {len(self.problems)} prompts (the first: problem "
                             f"{long[0] + 1}, {len(self.problems[long[0]].prompt_ids)} tokens) leave no room for "
                             f"--max-new-tokens {self.max_new_tokens} within context_length={self.context_length}")

    def _batch(self, numbers: Sequence[int]) -> tuple[Tensor, Tensor]:
        x = torch.tensor(numbers, dtype=torch.long)[:, None]                       # (rows, 1)
        return x, x.clone()

    def draw(self, rows: int, generator: torch.Generator, share: tuple[int, int] = WHOLE) -> tuple[Tensor, Tensor]:
        return self._batch(torch.randint(len(self.problems), (rows,), generator=generator)[share_rows(rows, share)].tolist())

    def eval_batches(self, rows: int, iters: int, generator: torch.Generator, per_draw: int | None = None,
                     share: tuple[int, int] = WHOLE) -> Iterator[tuple[Tensor, Tensor, float]]:
        """Every problem once, each batch weighted by its problems."""
        for start in range(0, len(self.problems), rows):
            numbers = list(range(start, min(start + rows, len(self.problems))))
            yield *self._batch(numbers[share_rows(len(numbers), share)]), float(len(numbers))

    def eval_batch_count(self, rows: int, iters: int, per_draw: int | None = None) -> int:
        return -(-len(self.problems) // rows)

    def tokens_per_row(self) -> float:
        """Prompt positions per problem, on average (the completions' are not known before sampling)."""
        return sum(len(p.prompt_ids) for p in self.problems) / max(1, len(self.problems))


def as_batch_source(data: Tensor | BatchSource | None, context_length: int) -> BatchSource | None:
    """A batch source as given, or the windows of a token stream."""
    if data is None or hasattr(data, "draw"):
        return data  # type: ignore[return-value]
    return WindowBatches(data, context_length)  # type: ignore[arg-type]

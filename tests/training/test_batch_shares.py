"""A process's share of a global batch (glasslm.training.batches, `share=(index, count)`) is what
torch's tensor_split of the whole batch gives it, for every kind of batch source, in training draws
and validation batches; the generator moves as for the whole batch."""

from __future__ import annotations

import random

import pytest
import torch

from glasslm.data.preferences import PreferencePair
from glasslm.data.problems import EncodedProblem
from glasslm.data.sft import IGNORE_INDEX, SFTExample
from glasslm.training.batches import PreferenceBatches, ProblemBatches, SFTBatches, WindowBatches, share_rows


def example(rng: random.Random) -> SFTExample:
    n = rng.randint(3, 12)  # lengths differ: padding is the whole batch's, not the share's
    ids = [rng.randrange(50) for _ in range(n)]
    return SFTExample(ids, [IGNORE_INDEX] * (n // 2) + ids[n // 2 + 1:] + [IGNORE_INDEX])


def sources():
    rng = random.Random(0)
    examples = [example(rng) for _ in range(9)]
    return {
        "windows": WindowBatches(torch.arange(500) % 97, 8),
        "sft": SFTBatches(examples, context_length=10),
        "preferences": PreferenceBatches([PreferencePair(a, b) for a, b in zip(examples, examples[1:])], 10),
        "problems": ProblemBatches([EncodedProblem(None, "p", [1] * (i + 1)) for i in range(7)], 16, 4),
    }


@pytest.mark.parametrize("name", ["windows", "sft", "preferences", "problems"])
@pytest.mark.parametrize("count", [2, 3, 4])
def test_a_share_is_the_tensor_split_of_the_whole_batch(name, count):
    source = sources()[name]
    whole_rng = torch.Generator().manual_seed(5)
    whole = source.draw(12, whole_rng)
    whole_val = list(source.eval_batches(4, 2, torch.Generator().manual_seed(6), per_draw=8))
    for index in range(count):
        rng = torch.Generator().manual_seed(5)
        share = source.draw(12, rng, share=(index, count))
        assert torch.equal(rng.get_state(), whole_rng.get_state()), "the generator moves as for the whole batch"
        for part, full in zip(share, whole):
            assert torch.equal(part, full.tensor_split(count)[index])
        val = list(source.eval_batches(4, 2, torch.Generator().manual_seed(6), per_draw=8, share=(index, count)))
        assert len(val) == len(whole_val)
        for (x, y, weight), (wx, wy, wweight) in zip(val, whole_val):
            assert torch.equal(x, wx.tensor_split(count)[index]) and torch.equal(y, wy.tensor_split(count)[index])
            assert weight == wweight, "a validation batch weighs as the whole batch"


def test_share_rows_covers_every_row_once():
    for rows in range(0, 13):
        for count in range(1, 6):
            covered = [i for index in range(count) for i in range(rows)[share_rows(rows, (index, count))]]
            assert covered == list(range(rows))
            assert [share_rows(rows, (i, count)).stop - share_rows(rows, (i, count)).start for i in range(count)] \
                == [len(t) for t in torch.arange(rows).tensor_split(count)]

"""`glasslm train`, with one failure injected for the multi-node test (tests/training/test_multinode.py):
with GLASSLM_TEST_FAIL_AT_STEP=k and GLASSLM_TEST_FAIL_MARKER=FILE set, the process of rank 1 exits
with code 1 as it starts step k, once (FILE records that it did), as a node that dies would."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from glasslm.cli import main
from glasslm.training import loop

_step = loop.train_step
_calls = [0]


def _failing_step(parts, *args, **kwargs):
    marker = Path(os.environ["GLASSLM_TEST_FAIL_MARKER"])
    _calls[0] += 1
    starting = parts.point.step + _calls[0]  # the step this call makes
    if os.environ.get("RANK") == "1" and not marker.exists() and starting == int(os.environ["GLASSLM_TEST_FAIL_AT_STEP"]):
        marker.write_text(f"rank 1 exited at step {starting}\n")
        sys.stdout.flush()
        os._exit(1)
    return _step(parts, *args, **kwargs)


if "GLASSLM_TEST_FAIL_AT_STEP" in os.environ:
    loop.train_step = _failing_step

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

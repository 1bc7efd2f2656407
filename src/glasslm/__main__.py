"""The `glasslm` executable (pyproject's [project.scripts]) and `python -m glasslm ...`: the command line
of glasslm.cli, imported with Python's cycle collector off and then frozen.

Why: importing torch and the command line leaves ~270,000 objects that live as long as the process, and
the collector walked all of them several times: four full collections in a `glasslm generate` on SmolLM2
(0.19 s together), and more in the interpreter's teardown at exit. Frozen (`gc.freeze`), they are
left out of every later collection, as CPython's documentation suggests for a process's start-up; what a
command makes afterwards is collected as usual. A library user's process is not touched: only this entry
point freezes anything (`import glasslm.cli` does not).
"""

from __future__ import annotations

import gc
from typing import NoReturn

from glasslm.runtime import collector_paused


def run() -> NoReturn:
    """Import the command line with the collector off, freeze what the imports made, then run it."""
    with collector_paused():
        from glasslm.cli import run as run_command_line
        gc.freeze()
    run_command_line()


if __name__ == "__main__":
    run()

"""`python -m glasslm ...` is the `glasslm` command."""

from glasslm.cli import run

run()

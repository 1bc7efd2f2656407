"""`python -m glasslm ...` is the `glasslm` command."""

from .cli import run

run()

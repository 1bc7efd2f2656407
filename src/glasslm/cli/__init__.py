"""The `glasslm` command line: `glasslm --help` lists the commands."""

from glasslm.cli.commands import main, run

__all__ = ["main", "run"]

"""`python -m glasslm.cli` (the form torchrun takes) runs the `glasslm` command."""

from glasslm.cli import run

if __name__ == "__main__":
    run()

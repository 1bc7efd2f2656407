"""`python -m glasslm ...` is the `glasslm` command."""

import sys

from .cli import main

sys.exit(main())

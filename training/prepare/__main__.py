"""`python -m training.prepare ...`: see training/prepare/cli.py."""

import contextlib
import sys

from training.prepare.cli import main

with contextlib.suppress(BrokenPipeError):
    sys.exit(main())

"""`python -m training.prepare ...`: see training/prepare/prepare_cli.py."""

import contextlib
import sys

from training.prepare.prepare_cli import main

with contextlib.suppress(BrokenPipeError):
    sys.exit(main())

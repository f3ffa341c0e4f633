"""`python -m training.evaluate ...`: see training/evaluate/cli.py."""

import sys

from training.evaluate.cli import main

if __name__ == "__main__":
    sys.exit(main())

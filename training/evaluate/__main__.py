"""`python -m training.evaluate ...`: see training/evaluate/evaluate_cli.py."""

import sys

from training.evaluate.evaluate_cli import main

if __name__ == "__main__":
    sys.exit(main())

"""How every prodip command ends: a clear one-line error and exit 2 on bad input, no traceback
unless --debug; 130 on Ctrl-C. Shared by train, sft, prepare, evaluate, export, serving and demo."""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130


def guarded(fn: Callable[[], int | None], *, debug: bool = False,
            errors: tuple[type[BaseException], ...] = (ValueError, OSError), interrupted_hint: str = "") -> int:
    """Run `fn`; turn the expected failures into `error: <first line>` (+ detail lines) on stderr."""
    try:
        rc = fn()
    except errors as e:
        if debug:
            raise
        first, _, rest = str(e).partition("\n")
        print(f"error: {first}", file=sys.stderr)
        if rest:
            print(rest, file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if interrupted_hint:
            print(interrupted_hint, file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK if rc is None else rc

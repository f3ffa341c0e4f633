"""How every prodip command ends: a clear one-line error and exit 2 on bad input, no traceback
unless --debug; 130 on Ctrl-C; 3 (EXIT_PREEMPTED) for a training run stopped by SIGTERM/SIGUSR1 on a
checkpoint (training.loop.preempt_signals). Shared by train, sft, prepare, evaluate, export, serving and demo."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130
# a run stopped by a preemption signal once its checkpoint was written (training.loop.preempt_signals): requeue it
EXIT_PREEMPTED = 3


class Preempted(Exception):  # noqa: N818 (a request that was honoured, not a failure)
    """Raised by training.loop.preempt_signals's caller once the checkpoint is on disk; `guarded` prints its message
    (empty on ranks other than 0, so torchrun's output holds the line once) and exits EXIT_PREEMPTED."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that refuses a command line (unknown flag, bad value, missing argument) with the same
    one `error: argument --lr: ...` line and exit 2 as every other bad input: no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {' '.join(message.split())}\n")


def to_stderr(text: str) -> None:
    """`text` and its newline in one write: stderr is unbuffered (write-through), so print()'s two writes
    let another torchrun rank's line land between a message and its newline on the shared pipe."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def run_main(parser: argparse.ArgumentParser, argv: Sequence[str] | None, body: Callable[[argparse.Namespace], int | None],
             *, errors: tuple[type[BaseException], ...] = (ValueError, OSError), interrupted_hint: str = "") -> int:
    """A CLI's main(): parse `argv`, then run `body(args)` under `guarded`. Returns the exit status in
    both cases (a bad flag: 2, `--help`: 0), so tests can call main(argv) in-process."""
    from training.text.normalization import check_arg

    try:
        for a in sys.argv[1:] if argv is None else argv:  # non-UTF-8 bytes: refused before anything runs
            check_arg(str(a), "argument", ValueError)
    except ValueError as e:
        to_stderr(f"error: {e}")
        return EXIT_USAGE
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the help or the one error line
        return e.code if isinstance(e.code, int) else EXIT_OK if e.code is None else EXIT_USAGE

    def call() -> int | None:
        rc = body(args)
        return rc if type(rc) is int else None  # a summary a body returns (a dict) is not an exit status

    return guarded(call, debug=getattr(args, "debug", False), errors=errors, interrupted_hint=interrupted_hint)


def guarded(fn: Callable[[], int | None], *, debug: bool = False,
            errors: tuple[type[BaseException], ...] = (ValueError, OSError), interrupted_hint: str = "") -> int:
    """Run `fn`; turn the expected failures into `error: <first line>` (+ detail lines) on stderr."""
    try:
        rc = fn()
    except Preempted as e:  # the checkpoint is on disk: one line (rank 0's), and a status a scheduler can requeue on
        if str(e):
            to_stderr(str(e))
        return EXIT_PREEMPTED
    except errors as e:
        if debug:
            raise
        first, _, rest = str(e).partition("\n")
        to_stderr(f"error: {first}" + (f"\n{rest}" if rest else ""))
        return EXIT_USAGE
    except KeyboardInterrupt:
        if interrupted_hint:
            to_stderr(interrupted_hint)
        return EXIT_INTERRUPTED
    return EXIT_OK if rc is None else rc

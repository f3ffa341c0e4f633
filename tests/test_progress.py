"""training.runfiles.progress.bar: a live bar on a terminal, nothing at all in a log file or a pipe."""

from __future__ import annotations

import io

from training.runfiles.progress import bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(file: io.StringIO, enabled: bool = True) -> list[int]:
    with bar(range(50), desc="encode", file=file, enabled=enabled, mininterval=0) as b:
        return list(b)


def test_a_terminal_gets_the_bar() -> None:
    term = Terminal()
    assert run(term) == list(range(50))
    assert "encode" in term.getvalue() and "\r" in term.getvalue()


def test_a_log_file_gets_nothing() -> None:
    log = io.StringIO()  # isatty() is False: a file, a pipe, CI
    assert run(log) == list(range(50))  # the work is done all the same
    assert log.getvalue() == ""


def test_disabled_by_the_caller_even_on_a_terminal() -> None:
    term = Terminal()
    run(term, enabled=False)
    assert term.getvalue() == ""


def test_a_manual_bar_counts() -> None:
    term = Terminal()
    with bar(total=10, desc="clean", unit="B", file=term, mininterval=0) as b:
        b.update(4)
        b.update(6)
        assert b.n == 10
    assert "clean" in term.getvalue()

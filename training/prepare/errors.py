"""The errors of training.prepare: a leaf module, so every sibling can raise them."""

from __future__ import annotations

from training.gates import GateResult


class PrepareError(ValueError):
    """Bad input or options: the CLI prints it as one line and exits 2."""


class GateFailed(PrepareError):
    """A tokenizer gate failed: nothing was written (exit 1). Carries the report and the gates."""

    def __init__(self, message: str, report: dict, gates: list[GateResult]):
        super().__init__(message)
        self.report, self.gates = report, gates


class Unreadable(Exception):
    """A file that cannot be read as text documents (skipped, or fatal with --strict)."""

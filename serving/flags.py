"""argparse `type=` converters for the names serving's users type, shared by the `python -m serving`
and `python -m export.evaluate` command lines (numbers use training.runfiles.schema.flag). Light: no runtime,
no web framework imported."""

from __future__ import annotations

import argparse

from serving import ALIASES
from training.runfiles.schema import SchemaError, one_of


def backend_name(text: str) -> str:
    """--backend: any name or alias in serving.RUNTIMES, nearest one suggested."""
    try:
        return one_of("backend", text, ALIASES)
    except SchemaError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


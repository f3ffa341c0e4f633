"""Rank agreement: per-rank work that may fail ends in the same place on every rank.

`agreed(d, device, what, fn)` runs `fn` on this rank; when it fails on any rank, every rank raises
(its own error where it failed, a DistError naming the failed ranks elsewhere) before the next
collective, so no rank is left waiting in it. Single process it is just `fn()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from training import distributed as D
from training import gates
from training.checkpoint import checkpoint_io as ckpt
from training.data.loaders import DataError
from training.runfiles import layout
from training.runfiles.schema import SchemaError
from training.text.tokenizer import TokenizerError
from training.train_config import ConfigError

T = TypeVar("T")


class TrainError(ValueError):
    pass


# what a training CLI turns into one `error:` line and exit 2 (OSError: a full disk, a missing path)
USER_ERRORS = (ConfigError, SchemaError, DataError, TokenizerError, ckpt.CheckpointError, gates.GateError,
               layout.LayoutError, TrainError, OSError, D.DistError)


def agreed(d: D.Dist, device: torch.device, what: str, fn: Callable[[], T]) -> T | None:
    """fn()'s result on every rank, or the same failure on every rank (see the module doc)."""
    error, out = None, None
    try:
        out = fn()
    except USER_ERRORS as e:
        error = e
    d.raise_if_any(error, device, what)
    return out

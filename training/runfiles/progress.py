"""Progress bars for long steps (prepare, export, parity, evaluation) that stay out of logs.

`bar(...)` is tqdm with one policy: drawn only when the caller enables it and its stream (stderr)
is a terminal. tqdm decides that itself (`disable=None`), so CI logs, `nohup` files and pipes get
no carriage-return frames, while the step's own summary lines still say what happened.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

MIN_INTERVAL_S = 0.5  # redraw at most twice a second: cheap on a busy 2-core machine


def bar(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """tqdm(iterable, **kwargs), disabled unless `enabled` and its file (stderr by default) is a tty.

    Defaults: leave=False (a finished bar clears, the caller prints its result), dynamic width."""
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("mininterval", MIN_INTERVAL_S)
    return tqdm(iterable, disable=None if enabled else True, **kwargs)

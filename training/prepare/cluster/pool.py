"""An ordered, bounded parallel map over chunks of documents, shared by the clean and encode passes.

Documents go in chunks of about CHUNK_CHARS to `workers` processes; at most IN_FLIGHT_PER_WORKER
chunks per worker are in flight and results come back in input order, so memory stays flat and
the output is identical for any worker count. spawn, not fork: the parent holds threads (tqdm's
monitor, SentencePiece) that fork would copy in a broken state.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

CHUNK_CHARS = 1 << 20  # characters per task: large enough to amortize IPC
IN_FLIGHT_PER_WORKER = 2


def chunks(items: Iterable[Any], size_of: Callable[[Any], int] = len) -> Iterator[list]:
    chunk: list = []
    size = 0
    for item in items:
        chunk.append(item)
        size += size_of(item)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def resolve_workers(workers: int | None) -> int:
    return workers or os.cpu_count() or 1


def ordered_map(fn: Callable, tasks: Iterable[tuple], workers: int, initializer: Callable,
                initargs: tuple) -> Iterator[Any]:
    """fn(*task) for every task, in order; in this process when workers == 1."""
    if workers == 1:
        initializer(*initargs)
        for task in tasks:
            yield fn(*task)
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, task))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

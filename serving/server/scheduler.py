"""The HTTP server's one owner of "one generation at a time": a single generation thread per app,
fed by a bounded queue of jobs. Nothing else in the server decides whose turn it is (a backend may
still guard its own state, as LlamaCppBackend's context lock does: only this thread ever takes it here).

Request handlers never block a thread: `submit(work)` queues a job (or raises `Busy` at once when
`max_waiting` jobs already wait), and the handler awaits the job's events on the event loop. The
generation thread takes jobs in arrival order and runs each one whole: `work(job)` (preparing the prompt:
tokenizing, fitting the history to the context; the job is the turn, a serving.text_stream.GenerationTurn,
given to the TextStream it makes) and then that stream, each text piece handed to the event loop as it
comes (`loop.call_soon_threadsafe`). A handler whose job has not started within `wait_s` withdraws it
and answers 503 with Retry-After (`Busy`); a client that hangs up withdraws its waiting job, or cancels
its running one at the next token (`Job.cancel`).

Why one thread and not a lock: the lock it replaces was held across a stream's yields and taken by
blocking inside the request worker threads, so once every worker thread waited for it, the stream
holding it never got a thread again (64 concurrent streams deadlocked the server). Here the waiting
is a place in a queue, not a thread, and the generating stream never needs a request thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from serving.text_stream import GenerationProbe, GenerationStats, TextStream

DEFAULT_MAX_WAITING = 32  # requests waiting for their turn beyond the running one; more are refused (503)
DEFAULT_WAIT_S = 60.0  # the longest a request waits for its turn before a 503
POLL_S = 0.2  # how often a waiting handler checks for its client's hang-up and its deadline
RETRY_AFTER_RANGE = (1, 120)  # seconds, the Retry-After a 503 suggests (estimated from recent generations)

Work = Callable[["Job"], tuple[Any, TextStream]]  # given its job, the TextStream's turn


class Busy(Exception):
    """No turn for this request now (the queue is full, or its wait ran out): a 503 with Retry-After."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client hung up (mid-body, while waiting, or mid-reply): nobody to answer; one log line."""


@dataclass(eq=False)
class Job:
    """One request's generation: its events (("ready", payload) | ("piece", text) | ("error", exc) |
    ("end", None)) cross from the generation thread to the handler through `_events` + `_signal`. Also
    the turn its TextStream holds (serving.text_stream.GenerationTurn): the generation thread gave it."""

    work: Work
    loop: asyncio.AbstractEventLoop
    arrived: float
    probe: GenerationProbe
    state: str = "waiting"  # waiting -> running -> done, or waiting -> withdrawn
    stream: TextStream | None = None
    _events: deque = field(default_factory=deque)
    _signal: asyncio.Event = field(default_factory=asyncio.Event)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _next_tick: float = 0.0  # time.monotonic() of the handler's next look at its client

    def put(self, kind: str, value: Any) -> None:
        """From the generation thread: hand one event to the handler's loop (gone: cancel the job)."""
        self._events.append((kind, value))
        try:
            self.loop.call_soon_threadsafe(self._signal.set)
        except RuntimeError:  # the server's loop has closed: nobody will read this job
            self.cancel()

    @contextlib.contextmanager
    def hold(self, stats: GenerationStats) -> Iterator[None]:
        """The stream's turn: it came when the generation thread took this job; counted as running."""
        stats.queued_at, stats.started_at = self.arrived, time.perf_counter()
        with self.probe.running(stats):
            yield

    def cancel(self) -> None:
        self._cancelled.set()
        if self.stream is not None:
            self.stream.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def next_event(self, tick: Callable[[], Awaitable[None]] | None = None) -> tuple[str, Any]:
        """The next event; `tick` runs at most every POLL_S meanwhile, also while events keep coming
        (it raises to give up: a client that hung up mid-reply is noticed between two pieces)."""
        while True:
            now = time.monotonic()
            if tick is not None and now >= self._next_tick:
                self._next_tick = now + POLL_S
                await tick()
            if self._events:
                return self._events.popleft()
            self._signal.clear()
            if self._events:
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._signal.wait(), max(0.0, self._next_tick - now) if tick else POLL_S)


class Scheduler:
    """The app's generation thread and its bounded queue (one per app: one model, one context), and the
    record of its turns (`probe`: /health and app.state.generations report it)."""

    def __init__(self, max_waiting: int = DEFAULT_MAX_WAITING, wait_s: float = DEFAULT_WAIT_S):
        self.probe, self.max_waiting, self.wait_s = GenerationProbe(), max_waiting, wait_s
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the waiting jobs times the median recent generation."""
        durations = [s.ended_at - s.started_at for s in list(self.probe.recent) if s.ended_at and s.started_at]
        each = statistics.median(durations) if durations else 1.0
        lo, hi = RETRY_AFTER_RANGE
        return int(min(hi, max(lo, math.ceil(each * (len(self._waiting) + 1)))))

    def submit(self, work: Work, arrived: float | None = None) -> Job:
        """Queue `work` for the generation thread (from the event loop), or raise Busy when full."""
        job = Job(work, asyncio.get_running_loop(), time.perf_counter() if arrived is None else arrived, self.probe)
        with self._cv:
            if self._closed:
                raise Busy("the server is shutting down", self.retry_after())
            if len(self._waiting) >= self.max_waiting:
                self.probe.refuse()
                raise Busy(f"the server is busy: {len(self._waiting)} requests are already waiting for the "
                           "model; retry later", self.retry_after())
            self._waiting.append(job)
            self.probe.wait_begin()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="prodip-generation", daemon=True)
                self._thread.start()
            self._cv.notify()
        return job

    def withdraw(self, job: Job) -> bool:
        """Take a job that has not started out of the queue (True), or False when it already runs."""
        with self._cv:
            if job.state != "waiting":
                return False
            job.state = "withdrawn"
            self._waiting.remove(job)
            self.probe.wait_end()
            return True

    def close(self) -> None:
        """Stop taking jobs (the server is stopping): the waiting ones are answered 503, the running one
        finishes (or ends at its next token when its handler is cancelled) and the thread exits."""
        with self._cv:
            self._closed = True
            for job in self._waiting:
                job.state = "withdrawn"
                job.cancel()
                job.put("error", Busy("the server is shutting down", RETRY_AFTER_RANGE[0]))
                self.probe.wait_end()
            self._waiting.clear()
            self._cv.notify()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                job.state = "running"
                self.probe.wait_end()
            try:
                self._run(job)
            finally:
                job.state = "done"

    def _run(self, job: Job) -> None:
        """Prepare, then generate, handing each event over; every failure goes to the handler."""
        try:
            payload, stream = job.work(job)
        except Exception as e:  # noqa: BLE001 - the handler answers it (400 for a client's mistake)
            job.put("error", e)
            return
        job.stream = stream  # the job's own record: cancel() reaches the generation through it
        if job.cancelled:
            stream.cancel()
        job.put("ready", payload)
        pieces = iter(stream)
        try:
            for piece in pieces:
                job.put("piece", piece)
        except Exception as e:  # noqa: BLE001 - mid-stream: reported in-band by the handler
            job.put("error", e)
        else:
            job.put("end", None)
        finally:
            pieces.close()

    # the handler's side (on the event loop) ------------------------------------------------------
    async def start(self, job: Job, disconnected: Callable[[], Awaitable[bool]]) -> Any:
        """Wait for the job's turn and its prepared payload; Busy when the turn does not come within
        wait_s, ClientGone when the client hangs up first; a failure of `work` is raised here."""
        deadline = job.arrived + self.wait_s

        async def tick() -> None:
            if await disconnected():
                raise ClientGone("the client disconnected while waiting for its turn")
            if time.perf_counter() > deadline and self.withdraw(job):
                self.probe.refuse()
                raise Busy(f"the server is busy: no turn for this request within {self.wait_s:g} s; retry later",
                           self.retry_after())

        try:
            kind, value = await job.next_event(tick)
        except BaseException:  # Busy, ClientGone, or the handler cancelled: the job's place is freed
            if not self.withdraw(job):
                job.cancel()
            raise
        if kind == "error":
            raise value
        return value

    async def pieces(self, job: Job, disconnected: Callable[[], Awaitable[bool]] | None = None
                     ) -> AsyncIterator[str]:
        """The started job's text pieces; leaving early (a hang-up, an error, a cancelled handler)
        cancels its generation at the next token. `disconnected`, when given, is polled meanwhile."""

        async def tick() -> None:
            if disconnected is not None and await disconnected():
                raise ClientGone("the client disconnected while its answer was generated")

        ended = False
        try:
            while True:
                kind, value = await job.next_event(tick)
                if kind == "error":
                    raise value
                if kind == "end":
                    ended = True
                    return
                yield value
        finally:
            if not ended:
                job.cancel()

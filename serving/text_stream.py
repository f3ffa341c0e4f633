"""Text out of a backend's token stream, shared by the CLI, the HTTP server and the demo.

`TextStream` turns a backend's token stream into text pieces through `training.text.wellformed.decode_utf8`
over the tokens' bytes (`bytes_decoder`): incomplete UTF-8 is held back until it completes, a byte
sequence that never becomes UTF-8 is dropped and counted (`stats.invalid_bytes`), so no U+FFFD is
ever shown; stop strings end the reply (and are never shown, not even in part), timing is recorded.
`cancel()` ends a stream at its next token (from any thread), recorded as finish_reason "cancelled".
A stream is given its `GenerationTurn` (its place in "one generation at a time") when it is made, and holds it
for its whole generation; one owner per program hands turns out: the HTTP server's
serving.server.scheduler.Scheduler (each Job is a turn), the demo's `ModelTurns` (one per model), or none
(`OwnTurn`, the default: the terminal's one consumer). `GenerationProbe` is an owner's record of its
turns. What the prompt is (a conversation fitted to the context, a completion) is serving.chat_session's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from serving.backend import Backend, SamplingParams
from training.text.wellformed import REPLACEMENT, decode_utf8

REPLACEMENT_CHAR = REPLACEMENT  # what a lenient decoder writes for bytes that are not (yet) UTF-8
RECENT_STATS = 64  # GenerationProbe keeps the stats of this many finished generations


def bytes_decoder(backend: Backend) -> Callable[[Sequence[int]], bytes]:
    """ids -> raw bytes (not yet UTF-8-checked), callable while `generate` is suspended mid-stream:
    the backend's `detokenize_bytes` (llama.cpp, transformers), else its SentencePiece tokenizer's pieces
    (torch, onnx), else its `detokenize` text encoded (a U+FFFD in it then stays one). Cached per backend."""
    cached = getattr(backend, "_prodip_bytes_decoder", None)
    if cached is not None:
        return cached
    own = getattr(backend, "detokenize_bytes", None)
    tok = getattr(backend, "tokenizer", None)
    if callable(own):
        dec = own
    elif tok is not None and callable(getattr(tok, "decode_bytes", None)):
        dec = tok.decode_bytes
    else:
        def dec(ids: Sequence[int]) -> bytes:
            return backend.detokenize(ids).encode("utf-8")
    with contextlib.suppress(AttributeError):
        backend._prodip_bytes_decoder = dec  # type: ignore[attr-defined]
    return dec


def text_decoder(backend: Backend) -> Callable[[Sequence[int]], str]:
    """ids -> text, invalid byte sequences dropped (never U+FFFD): decode_utf8 over bytes_decoder."""
    dec = bytes_decoder(backend)
    return lambda ids: decode_utf8(dec(ids)).text


@dataclass
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int = 0
    time_to_first_token_s: float | None = None
    total_s: float = 0.0
    finish_reason: str | None = None  # "stop" (end of turn or stop string) | "length" | "cancelled" (closed early)
    invalid_bytes: int = 0  # byte sequences the model left invalid UTF-8: dropped from the text
    # time.perf_counter() when the request arrived (or the stream asked for the lock), got the lock, and
    # its generation loop ended
    queued_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Generation speed after the first token (the first one pays for the prompt)."""
        if self.time_to_first_token_s is None or self.completion_tokens < 2:
            return None
        dt = self.total_s - self.time_to_first_token_s
        return (self.completion_tokens - 1) / dt if dt > 0 else None


def _held_tail(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class GenerationProbe:
    """Counts generations as they wait for their turn and run: the server's record of its one-at-a-time,
    bounded-queue and stop-on-disconnect guarantees (the HTTP tests read it; /health reports it)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.waiting = self.active = self.peak_waiting = self.peak_active = self.started = self.finished = 0
        self.refused = 0  # requests answered 503: the queue was full, or their turn did not come in time
        self.recent: deque[GenerationStats] = deque(maxlen=RECENT_STATS)  # bounded: a server runs for days

    def wait_begin(self) -> None:
        with self._mu:
            self.waiting += 1
            self.peak_waiting = max(self.peak_waiting, self.waiting)

    def wait_end(self) -> None:
        with self._mu:
            self.waiting -= 1

    def refuse(self) -> None:
        with self._mu:
            self.refused += 1

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        self.wait_begin()
        try:
            yield
        finally:
            self.wait_end()

    @contextlib.contextmanager
    def running(self, stats: GenerationStats) -> Iterator[None]:
        with self._mu:
            self.active += 1
            self.started += 1
            self.peak_active = max(self.peak_active, self.active)
        try:
            yield
        finally:
            with self._mu:
                self.active -= 1
                self.finished += 1
                self.recent.append(stats)

    def snapshot(self) -> dict:
        with self._mu:
            return {"waiting": self.waiting, "active": self.active, "peak_waiting": self.peak_waiting,
                    "peak_active": self.peak_active, "started": self.started, "finished": self.finished,
                    "refused": self.refused}


class GenerationTurn(Protocol):
    """A generation's place in its model's "one generation at a time", given to its TextStream when it
    is made: `hold(stats)` waits for the turn where it must (recording stats.queued_at / started_at) and
    holds it, counted by its owner's GenerationProbe, for as long as the generation runs."""

    def hold(self, stats: GenerationStats) -> AbstractContextManager[None]: ...


class OwnTurn:
    """The turn of a caller that has the model to itself (the terminal: one consumer): nothing to wait
    for; counted by a probe of its own."""

    def __init__(self) -> None:
        self.probe = GenerationProbe()

    @contextlib.contextmanager
    def hold(self, stats: GenerationStats) -> Iterator[None]:
        stats.queued_at = stats.started_at = time.perf_counter()
        with self.probe.running(stats):
            yield


class ModelTurns:
    """The owner of "one generation at a time" over one model whose consumers each have a thread of their
    own (the demo: Gradio's workers bound them): a lock held for each whole generation, and the record
    of it (`probe`). Given to each TextStream as its `turn`, or held around any other use of the model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.probe = GenerationProbe()

    def locked(self) -> bool:
        """Whether a generation holds the model now."""
        return self._lock.locked()

    @contextlib.contextmanager
    def hold(self, stats: GenerationStats) -> Iterator[None]:
        stats.queued_at = time.perf_counter()
        with self.probe.queued():
            self._lock.acquire()
        try:
            stats.started_at = time.perf_counter()
            with self.probe.running(stats):
                yield
        finally:
            self._lock.release()


@dataclass
class TextStream:
    """Iterate for text pieces; `stats` is complete once iteration ends. `params` is trusted (a
    SamplingParams is valid by construction); `turn` is held for the whole generation (default: OwnTurn)."""

    backend: Backend
    ids: list[int]
    params: SamplingParams
    turn: GenerationTurn = field(default_factory=OwnTurn)
    stats: GenerationStats = field(init=False)
    text: str = field(init=False, default="")
    _cancelled: threading.Event = field(init=False, default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """End the generation at its next token (safe from another thread); finish_reason "cancelled"."""
        self._cancelled.set()

    def __post_init__(self) -> None:
        self.stats = GenerationStats(prompt_tokens=len(self.ids))

    def __iter__(self) -> Iterator[str]:
        with self.turn.hold(self.stats):
            yield from self._run()

    def _run(self) -> Iterator[str]:
        stops = [s for s in self.params.stop if s]
        decode = bytes_decoder(self.backend)
        gen: list[int] = []
        emitted = 0
        text = ""
        t0 = time.perf_counter()
        finish = None
        tokens = self.backend.generate(self.ids, self.params)
        try:
            for tid in tokens:
                if self._cancelled.is_set():  # checked per token: a hung-up client costs at most one more
                    finish = "cancelled"
                    break
                if not gen:
                    self.stats.time_to_first_token_s = time.perf_counter() - t0
                gen.append(tid)
                self.stats.completion_tokens = len(gen)
                self.stats.total_s = time.perf_counter() - t0  # live, so tokens/s can be shown mid-reply
                # An incomplete character at the end waits for its next bytes; invalid ones are dropped.
                decoded = decode_utf8(decode(gen), final=False)
                text, self.stats.invalid_bytes = decoded.text, len(decoded.invalid)
                hits = [i for i in (text.find(s, emitted) for s in stops) if i >= 0]
                if hits:
                    cut = min(hits)
                    if cut > emitted:
                        yield text[emitted:cut]
                    text, emitted, finish = text[:cut], cut, "stop"
                    break
                safe = len(text) - _held_tail(text, stops)
                if safe > emitted:
                    yield text[emitted:safe]
                    emitted = safe
            else:
                # The backend ended by itself: end of turn, or the token budget / context ran out. Bytes
                # still incomplete now never will be: invalid.
                hit_budget = (len(gen) >= self.params.max_new_tokens
                              or len(self.ids) + len(gen) >= self.backend.n_ctx)
                finish = "length" if hit_budget else "stop"
                decoded = decode_utf8(decode(gen), final=True)
                text, self.stats.invalid_bytes = decoded.text, len(decoded.invalid)
                if len(text) > emitted:
                    yield text[emitted:]
                    emitted = len(text)
        except GeneratorExit:  # the consumer closed the stream (a client hung up): stop generating
            finish = "cancelled"
            raise
        finally:
            if hasattr(tokens, "close"):
                tokens.close()  # ends the backend's loop now (llama.cpp releases its context lock here)
            self.text = text[:emitted]
            self.stats.ended_at = time.perf_counter()
            self.stats.total_s = self.stats.ended_at - t0
            self.stats.finish_reason = finish


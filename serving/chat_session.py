"""Conversation handling shared by the CLI, the HTTP server and the demo, for every backend.

- Prompts are rendered through `training.chat` (the one template), tokenized by the backend's own
  tokenizer: an adapter gives `training.chat.encode` the few things it needs. A backend serving a
  file prodip did not write (`backend.prodip` False: a foreign GGUF) renders through the file's own
  template instead (`backend.render_chat`), or, with no template, continues the conversation as plain
  text and says so in the notice.
- When a conversation outgrows the context, the oldest non-system turns are dropped and the result
  carries a notice for the user; a single message that cannot fit is a `PromptTooLong` error.
- `TextStream` turns a backend's token stream into text pieces through `training.wellformed.decode_utf8`
  over the tokens' bytes (`bytes_decoder`): incomplete UTF-8 is held back until it completes, a byte
  sequence that never becomes UTF-8 is dropped and counted (`stats.invalid_bytes`), so no U+FFFD is
  ever shown; stop strings end the reply (and are never shown, not even in part), timing is recorded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from serving.backend import Backend, SamplingParams, ServingError
from training import layout
from training.chat import STOP_STRINGS, ChatError, encode, truncate_history, validate
from training.tokenizer import IM_END, IM_START
from training.wellformed import REPLACEMENT, decode_utf8

REPLACEMENT_CHAR = REPLACEMENT  # what a lenient decoder writes for bytes that are not (yet) UTF-8
# At most this share of the context is held back for the reply when fitting the history.
MAX_REPLY_SHARE = 0.5
RECENT_STATS = 64  # GenerationProbe keeps the stats of this many finished generations


class PromptTooLong(ServingError):
    pass


class BackendTokens:
    """What `training.chat.encode` needs from a tokenizer, answered by a backend's own tokenizer."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.bos_id = self._single(backend.tokenize("", bos=True), "<s>")
        self.im_start_id = self._single(backend.tokenize(IM_START, bos=False, allow_special=True), IM_START)
        self.im_end_id = self._single(backend.tokenize(IM_END, bos=False, allow_special=True), IM_END)

    def _single(self, ids: list[int], what: str) -> int:
        if len(ids) != 1:
            raise ServingError(f"{self.backend.name}: the model's tokenizer has no single {what} token (got {ids}); "
                               "it was not trained by prodip")
        return ids[0]

    def encode(self, text: str) -> list[int]:
        return self.backend.tokenize(text, bos=False, allow_special=False)


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


def backend_tokens(backend: Backend) -> BackendTokens:
    """Cached per backend object (three tokenizer calls, but asked on every request)."""
    cached = getattr(backend, "_prodip_chat_tokens", None)
    if cached is None:
        cached = BackendTokens(backend)
        with contextlib.suppress(AttributeError):  # a backend with __slots__: just do not cache
            backend._prodip_chat_tokens = cached  # type: ignore[attr-defined]
    return cached


@dataclass
class PreparedChat:
    ids: list[int]
    messages: list[dict]  # what was kept (normalized)
    dropped: int
    n_ctx: int
    stop: tuple[str, ...] = STOP_STRINGS  # the template's end-of-turn text (prodip: ours)
    fallback: str | None = None  # why there is no chat template (the prompt is plain text)

    @property
    def notice(self) -> str | None:
        notes = [self.fallback] if self.fallback else []
        if self.dropped:
            notes.append(f"the conversation outgrew the {self.n_ctx}-token context: "
                         f"dropped the {self.dropped} oldest message(s)")
        return "; ".join(notes) or None


def reply_reserve(n_ctx: int, max_new_tokens: int) -> int:
    return max(1, min(max_new_tokens, int(n_ctx * MAX_REPLY_SHARE)))


def is_prodip(backend: Backend) -> bool:
    """Whether the backend serves a model prodip wrote (every backend but a foreign GGUF)."""
    return bool(getattr(backend, "prodip", True))


def run_chat_tuned(path: str | Path) -> bool | None:
    """Whether the run holding `path` (a run, a checkpoint, a file under RUN/export) was chat fine-tuned:
    its run.json says kind "sft". None when no readable run config is there to say."""
    from training.sft_data import KIND as SFT_KIND  # training.sft_data pulls in the data stack: load on use

    run = layout.run_dir_of(path)
    try:
        cfg = layout.read_run_config(run) if run is not None else None
    except layout.LayoutError:
        return None
    return None if cfg is None else cfg.get("kind") == SFT_KIND


def chat_tuned(backend: Backend, path: str | Path | None = None) -> bool | None:
    """Whether `backend` serves a chat-tuned model: the file's own word first (a GGUF's CHAT_TUNED_KEY),
    then the run files around `path` (or backend.path). None: unknown (a bare checkpoint, an old GGUF
    away from its run, a foreign file, whose own template is used)."""
    own = getattr(backend, "chat_tuned", None)
    if own is not None:
        return bool(own)
    if not is_prodip(backend):
        return None
    p = path if path is not None else getattr(backend, "path", None)
    return run_chat_tuned(p) if p is not None else None


def _too_long(backend: Backend, n: int, budget: int) -> PromptTooLong:
    return PromptTooLong(f"the prompt is {n} tokens but the model's context is {backend.n_ctx} tokens "
                         f"({budget} after room for the reply); shorten the message")


def plain_text(messages: Sequence[dict]) -> str:
    """A conversation for a model without a chat template: the contents, one paragraph each."""
    return "\n\n".join(m["content"] for m in messages)


def _foreign_ids(backend: Backend, messages: list[dict]) -> tuple[list[int], tuple[str, ...]]:
    rendered = backend.render_chat(messages)  # type: ignore[attr-defined]
    if rendered is None:
        return backend.tokenize(plain_text(messages), bos=True, allow_special=False), ()
    prompt, stop = rendered
    # As llama-cpp-python's chat handler does: the template wrote BOS and the turn markers itself.
    return backend.tokenize(prompt, bos=False, allow_special=True), stop


def _oldest_turn(messages: list[dict]) -> int | None:
    """Index of the oldest non-system message that may go (never the last one), else None."""
    return next((i for i, m in enumerate(messages[:-1]) if m["role"] != "system"), None)


def prepare_foreign_chat(backend: Backend, msgs: list[dict], budget: int) -> PreparedChat:
    """The file's own template; the oldest non-system messages are dropped until the prompt fits (a
    reply left leading goes too: many templates insist that a conversation starts with the user)."""
    kept, dropped = list(msgs), 0
    while True:
        ids, stop = _foreign_ids(backend, kept)
        if len(ids) <= budget:
            return PreparedChat(ids, kept, dropped, backend.n_ctx, stop, getattr(backend, "chat_notice", None))
        oldest = _oldest_turn(kept)
        if oldest is None:  # only the last message (and any system prompt) is left
            raise _too_long(backend, len(ids), budget)
        del kept[oldest]
        dropped += 1
        while (i := _oldest_turn(kept)) is not None and kept[i]["role"] == "assistant":
            del kept[i]
            dropped += 1


def prepare_chat(backend: Backend, messages: Sequence[dict], params: SamplingParams) -> PreparedChat:
    """Validate + normalize the messages, drop the oldest turns until prompt + reply room fit."""
    msgs = validate(messages)
    if not msgs:
        raise ChatError("messages must not be empty")
    budget = backend.n_ctx - reply_reserve(backend.n_ctx, params.max_new_tokens)
    if not is_prodip(backend):
        return prepare_foreign_chat(backend, msgs, budget)
    tok = backend_tokens(backend)
    try:
        kept, dropped = truncate_history(tok, msgs, budget)  # type: ignore[arg-type]
    except ChatError:
        # Only the last message (and any system prompt) is left and still does not fit.
        n = len(encode(tok, [m for m in msgs if m["role"] == "system"] + [msgs[-1]]).ids)  # type: ignore[arg-type]
        raise _too_long(backend, n, budget) from None
    return PreparedChat(encode(tok, kept).ids, kept, dropped, backend.n_ctx)  # type: ignore[arg-type]


def prepare_completion(backend: Backend, prompt: str) -> list[int]:
    ids = backend.tokenize(prompt, bos=True, allow_special=False)
    if len(ids) >= backend.n_ctx:
        raise PromptTooLong(f"the prompt is {len(ids)} tokens but the model's context is {backend.n_ctx} tokens "
                            "(room for at least one new token is needed); shorten it")
    return ids


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
    """Counts generations as they wait for and hold the generation lock: the server's record of its
    one-at-a-time and stop-on-disconnect guarantees (the HTTP tests read it; /health reports it)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.waiting = self.active = self.peak_waiting = self.peak_active = self.started = self.finished = 0
        self.recent: deque[GenerationStats] = deque(maxlen=RECENT_STATS)  # bounded: a server runs for days

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        with self._mu:
            self.waiting += 1
            self.peak_waiting = max(self.peak_waiting, self.waiting)
        try:
            yield
        finally:
            with self._mu:
                self.waiting -= 1

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
                    "peak_active": self.peak_active, "started": self.started, "finished": self.finished}


@dataclass
class TextStream:
    """Iterate for text pieces; `stats` is complete once iteration ends. `lock` (if given) is held
    for the whole generation: llama.cpp contexts must not run two generations at once."""

    backend: Backend
    ids: list[int]
    params: SamplingParams
    lock: threading.Lock | None = None
    probe: GenerationProbe | None = None
    stats: GenerationStats = field(init=False)
    text: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.params = self.params.validate()
        self.stats = GenerationStats(prompt_tokens=len(self.ids))

    def __iter__(self) -> Iterator[str]:
        probe = self.probe or GenerationProbe()
        if self.stats.queued_at is None:  # a server sets it when the request arrived
            self.stats.queued_at = time.perf_counter()
        with probe.queued():
            if self.lock is not None:
                self.lock.acquire()
        self.stats.started_at = time.perf_counter()
        try:
            with probe.running(self.stats):
                yield from self._run()
        finally:
            if self.lock is not None:
                self.lock.release()

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


def chat_stream(backend: Backend, messages: Sequence[dict], params: SamplingParams,
                lock: threading.Lock | None = None) -> tuple[PreparedChat, TextStream]:
    """Prepare a conversation (may raise PromptTooLong / ChatError) and its reply stream."""
    params = params.validate()
    prepared = prepare_chat(backend, messages, params)
    chat_params = replace(params, stop=tuple(dict.fromkeys([*params.stop, *prepared.stop])))
    return prepared, TextStream(backend, prepared.ids, chat_params, lock)


def completion_stream(backend: Backend, prompt: str, params: SamplingParams,
                      lock: threading.Lock | None = None) -> TextStream:
    params = params.validate()
    return TextStream(backend, prepare_completion(backend, prompt), params, lock)


class ChatSession:
    """A conversation kept across turns (the terminal chat). Dropped turns stay dropped."""

    def __init__(self, backend: Backend, system: str | None = None, lock: threading.Lock | None = None):
        self.backend = backend
        self.lock = lock
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str, params: SamplingParams) -> tuple[PreparedChat, TextStream]:
        """Start a reply to `text`. Iterate the stream, then call `commit(stream)` to keep the turn."""
        prepared, stream = chat_stream(self.backend, [*self.messages, {"role": "user", "content": text}],
                                       params, self.lock)
        self._pending = prepared.messages
        return prepared, stream

    def commit(self, stream: TextStream) -> None:
        self.messages = [*self._pending, {"role": "assistant", "content": stream.text}]

"""Conversation handling shared by the CLI, the HTTP server and the demo, for every backend.

- Prompts are rendered through `training.text.chat_template` (the one template), tokenized by the backend's own
  tokenizer: an adapter gives `training.text.chat_template.encode` the few things it needs. A backend serving a
  file prodip did not write (`backend.prodip` False: a foreign GGUF) renders through the file's own
  template instead (`backend.render_chat`), or, with no template, continues the conversation as plain
  text and says so in the notice.
- When a conversation outgrows the context, the oldest non-system turns are dropped and the result
  carries a notice for the user; a single message that cannot fit is a `PromptTooLong` error. The
  cost is linear in the conversation (training.text.chat_template.truncate_history measures the newest turns only
  until the budget is spent; a foreign template is bisected), as a server does this for any client.
- The reply streams through `serving.text_stream.TextStream` (UTF-8-safe text pieces, stop strings,
  timing); this module decides what the prompt is and keeps a terminal conversation's turns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from serving.backend import Backend, SamplingParams, ServingError
from serving.text_stream import GenerationTurn, OwnTurn, TextStream
from training.runfiles import layout
from training.text.chat_template import STOP_STRINGS, ChatError, encode, truncate_history, validate
from training.text.tokenizer import IM_END, IM_START

# At most this share of the context is held back for the reply when fitting the history.
MAX_REPLY_SHARE = 0.5


class PromptTooLong(ServingError):
    pass


class BackendTokens:
    """What `training.text.chat_template.encode` needs from a tokenizer, answered by a backend's own tokenizer."""

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
    run = layout.run_dir_of(path)
    try:
        cfg = layout.read_run_config(run) if run is not None else None
    except layout.LayoutError:
        return None
    return None if cfg is None else cfg.get("kind") == layout.SFT_KIND


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


def _drop_cuts(msgs: list[dict]) -> tuple[list[int], list[int]]:
    """(droppable, cuts): the non-system messages but the last, oldest first, and how many of them are
    gone after each drop step (step 0: none). A step drops the oldest turn, then any reply left leading
    (many templates insist that a conversation starts with the user)."""
    droppable = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
    cuts, c = [0], 0
    while c < len(droppable):
        c += 1
        while c < len(droppable) and msgs[droppable[c]]["role"] == "assistant":
            c += 1
        cuts.append(c)
    return droppable, cuts


def prepare_foreign_chat(backend: Backend, msgs: list[dict], budget: int) -> PreparedChat:
    """The file's own template; the oldest non-system messages are dropped, step by step, until the
    prompt fits. A template is opaque (no per-message lengths), so the first step that fits is found by
    bisection, O(n log n) renders' worth instead of one render per dropped turn: the prompt only shrinks
    as turns go, so it is the step the one-by-one definition stops at."""
    droppable, cuts = _drop_cuts(msgs)

    def at(step: int) -> tuple[list[dict], list[int], tuple[str, ...]]:
        gone = set(droppable[:cuts[step]])
        kept = [m for i, m in enumerate(msgs) if i not in gone]
        return (kept, *_foreign_ids(backend, kept))

    def done(step: int, kept: list[dict], ids: list[int], stop: tuple[str, ...]) -> PreparedChat:
        return PreparedChat(ids, kept, cuts[step], backend.n_ctx, stop, getattr(backend, "chat_notice", None))

    first = at(0)
    if len(first[1]) <= budget:
        return done(0, *first)
    last = len(cuts) - 1
    tail = at(last)
    if len(tail[1]) > budget:  # only the last message (and any system prompt) is left
        raise _too_long(backend, len(tail[1]), budget)
    lo, hi, best = 0, last, tail  # step lo does not fit, step hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = at(mid)
        if len(got[1]) <= budget:
            hi, best = mid, got
        else:
            lo = mid
    return done(hi, *best)


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




@dataclass(frozen=True)
class GenerationRequest:
    """One generation as its entry made it (an HTTP body, the CLI's flags and line, the demo's widgets),
    every part checked there and trusted after: a chat (`messages`) or a text completion (`prompt`), its
    sampling (stop strings and max tokens included) and `adapter`, which base+adapter pair answers
    (serving.lora_pairs; None: the default)."""

    params: SamplingParams
    messages: Sequence[dict] | None = None
    prompt: str | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ServingError("a generation request is a chat (messages) or a completion (prompt): one of them")


def chat_stream(backend: Backend, messages: Sequence[dict], params: SamplingParams,
                turn: GenerationTurn | None = None) -> tuple[PreparedChat, TextStream]:
    """Prepare a conversation (may raise PromptTooLong / ChatError) and its reply stream, which holds
    `turn` while it generates (serving.text_stream.GenerationTurn; None: the caller has the model to itself)."""
    prepared = prepare_chat(backend, messages, params)
    return prepared, TextStream(backend, prepared.ids, params.with_stops(prepared.stop), turn or OwnTurn())


def completion_stream(backend: Backend, prompt: str, params: SamplingParams,
                      turn: GenerationTurn | None = None) -> TextStream:
    return TextStream(backend, prepare_completion(backend, prompt), params, turn or OwnTurn())


def open_stream(backend: Backend, request: GenerationRequest,
                turn: GenerationTurn | None = None) -> tuple[PreparedChat | None, TextStream]:
    """The request's reply stream over `backend` (the pair its adapter picked): a chat's prepared
    conversation beside it, None for a completion."""
    if request.messages is not None:
        return chat_stream(backend, request.messages, request.params, turn)
    return None, completion_stream(backend, request.prompt or "", request.params, turn)


class ChatSession:
    """A conversation kept across turns (the terminal chat). Dropped turns stay dropped."""

    def __init__(self, backend: Backend, system: str | None = None):
        self.backend = backend  # the terminal's own: one consumer, so no lock
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str, params: SamplingParams) -> tuple[PreparedChat, TextStream]:
        """Start a reply to `text`. Iterate the stream, then call `commit(stream)` to keep the turn."""
        prepared, stream = chat_stream(self.backend, [*self.messages, {"role": "user", "content": text}], params)
        self._pending = prepared.messages
        return prepared, stream

    def commit(self, stream: TextStream) -> None:
        self.messages = [*self._pending, {"role": "assistant", "content": stream.text}]

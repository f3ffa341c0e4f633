"""The route handlers of serving.http's app: /health, /v1/models, /v1/chat/completions and
/v1/completions (JSON or SSE streaming), each a method of one `Routes` holding the app's backend,
its generation lock and its GenerationProbe. Bodies are read and checked by serving.http_requests;
one generation runs at a time (the lock, held by the TextStream for its whole generation); a client
that hangs up mid-stream closes the stream, which closes the backend's token loop.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.backend import Backend
from serving.chat_session import chat_stream, completion_stream
from serving.http_requests import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    RequestError,
    ServerConfig,
    chat_messages,
    check_fields,
    completion_prompt,
    read_json,
    sampling_from_body,
    stream_flag,
)
from serving.text_stream import GenerationProbe, GenerationStats

SSE_DONE = "data: [DONE]\n\n"


def error_body(message: str, status: int) -> JSONResponse:
    one_line = " ".join(str(message).split())
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": one_line, "type": kind, "param": None, "code": None}}, status_code=status)


async def request_error(_: Request, e: RequestError) -> JSONResponse:
    return error_body(str(e), e.status)


async def value_error(_: Request, e: ValueError) -> JSONResponse:
    """ServingError, ChatError, PromptTooLong, TokenizerError: the client's mistake, one line."""
    return error_body(str(e), 400)


def _usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def _extras(stats: GenerationStats, dropped: int = 0, notice: str | None = None) -> dict:
    return {"dropped_messages": dropped, "notice": notice, "tokens_per_s": stats.tokens_per_s,
            "time_to_first_token_s": stats.time_to_first_token_s, "invalid_bytes": stats.invalid_bytes}


async def _pull(gen: Iterator[str]) -> AsyncIterator[str]:
    """Iterate a blocking generator off the event loop; close it (ending the generation, releasing its
    lock) at the end. A client that hangs up cancels this task: the close is shielded, as an await in a
    cancelled scope would otherwise raise before closing, leaving the model generating for nobody."""
    done = object()
    try:
        while True:
            item = await anyio.to_thread.run_sync(next, gen, done)
            if item is done:
                return
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(gen.close)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _in_band_error(e: ValueError) -> str:
    """A mistake found mid-stream: the headers are gone, so it is reported in-band, as OpenAI does."""
    return _sse({"error": {"message": " ".join(str(e).split()), "type": "invalid_request_error"}})


@dataclass
class Routes:
    """The handlers of one app, over its backend; `probe` counts generations under `lock`."""

    backend: Backend
    cfg: ServerConfig
    lock: threading.Lock
    probe: GenerationProbe
    created: int = field(default_factory=lambda: int(time.time()))

    async def health(self) -> dict:
        return {"status": "ok", "backend": self.backend.name, "model": self.cfg.model_id, "n_ctx": self.backend.n_ctx,
                "generations": self.probe.snapshot()}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.cfg.model_id, "object": "model", "created": self.created,
                                            "owned_by": "prodip"}]}

    def _locked(self, fn, *args):
        with self.lock:
            return fn(*args)

    async def _parse(self, request: Request, fields, what):
        """One body read and checked: (what(body), its sampling params, stream mode, arrival time)."""
        body = await read_json(request, self.cfg.max_body_bytes)
        check_fields(body, fields)
        payload = what(body)
        return payload, sampling_from_body(body, self.cfg.max_tokens_cap), stream_flag(body), time.perf_counter()

    async def chat_completions(self, request: Request) -> Response:
        messages, params, stream_mode, arrived = await self._parse(request, CHAT_FIELDS, chat_messages)
        prepared, stream = await anyio.to_thread.run_sync(self._locked, chat_stream, self.backend, messages, params)
        stream.lock, stream.probe, stream.stats.queued_at = self.lock, self.probe, arrived
        rid, now, model_id = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.cfg.model_id
        headers = {"X-Prodip-Dropped-Messages": str(prepared.dropped)}
        if not stream_mode:
            text = await anyio.to_thread.run_sync(lambda: "".join(stream))
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": now, "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": stream.stats.finish_reason}],
                "usage": _usage(stream.stats),
                "prodip": _extras(stream.stats, prepared.dropped, prepared.notice)}, headers=headers)

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        async def events() -> AsyncIterator[str]:
            yield _sse(chunk({"role": "assistant", "content": ""}))
            try:
                async for piece in _pull(iter(stream)):
                    yield _sse(chunk({"content": piece}))
            except ValueError as e:
                yield _in_band_error(e)
                return
            last = chunk({}, stream.stats.finish_reason)
            last["usage"] = _usage(stream.stats)
            last["prodip"] = _extras(stream.stats, prepared.dropped, prepared.notice)
            yield _sse(last)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def completions(self, request: Request) -> Response:
        prompt, params, stream_mode, arrived = await self._parse(request, COMPLETION_FIELDS, completion_prompt)
        stream = await anyio.to_thread.run_sync(self._locked, completion_stream, self.backend, prompt, params)
        stream.lock, stream.probe, stream.stats.queued_at = self.lock, self.probe, arrived
        rid, now, model_id = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.cfg.model_id

        def choice(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": model_id,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if not stream_mode:
            text = await anyio.to_thread.run_sync(lambda: "".join(stream))
            out = choice(text, stream.stats.finish_reason)
            out["usage"] = _usage(stream.stats)
            out["prodip"] = _extras(stream.stats)
            return JSONResponse(out)

        async def events() -> AsyncIterator[str]:
            try:
                async for piece in _pull(iter(stream)):
                    yield _sse(choice(piece, None))
            except ValueError as e:
                yield _in_band_error(e)
                return
            last = choice("", stream.stats.finish_reason)
            last["usage"] = _usage(stream.stats)
            last["prodip"] = _extras(stream.stats)
            yield _sse(last)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

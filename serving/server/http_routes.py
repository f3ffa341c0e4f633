"""The route handlers of serving.server.http_app's app: /health, /v1/models, /v1/chat/completions and
/v1/completions (JSON or SSE streaming), each a method of one `Routes` holding the app's backend and
its serving.server.scheduler.Scheduler, the one owner of the model: a request's prompt is prepared and its
reply generated on the scheduler's generation thread, and the handler awaits the pieces on the event
loop (no request thread ever waits for the model). Bodies are read and checked by serving.server.http_requests;
a full queue, or a turn that does not come in time, is a 503 with Retry-After; a client that hangs up
frees its place in the queue or stops its generation at the next token.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio.to_thread
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.backend import Backend
from serving.chat_session import GenerationRequest, open_stream
from serving.lora_pairs import Pairs
from serving.server.http_requests import (
    RequestError,
    ServerConfig,
    parse_body,
    read_body,
    request_from_body,
    stream_flag,
)
from serving.server.scheduler import Busy, ClientGone, Job, Scheduler
from serving.text_stream import GenerationProbe, GenerationStats, TextStream

SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never read by anyone
log = logging.getLogger("uvicorn.error")  # the server's own log, formatted as uvicorn's lines


def error_body(message: str, status: int) -> JSONResponse:
    one_line = " ".join(str(message).split())
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": one_line, "type": kind, "param": None, "code": None}}, status_code=status)


async def request_error(_: Request, e: RequestError) -> JSONResponse:
    return error_body(str(e), e.status)


async def value_error(_: Request, e: ValueError) -> JSONResponse:
    """ServingError, ChatError, PromptTooLong, TokenizerError: the client's mistake, one line."""
    return error_body(str(e), 400)


async def busy(_: Request, e: Busy) -> JSONResponse:
    """No turn for the request now: 503, and when to try again."""
    response = error_body(str(e), 503)
    response.headers["Retry-After"] = str(e.retry_after)
    return response


def _gone(request: Request, e: ClientGone) -> None:
    """A client that hung up: one log line, never a traceback."""
    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    log.info("%s %s: %s", client, request.url.path, e)


async def client_gone(request: Request, e: ClientGone) -> Response:
    """A client that hung up before its answer started: one log line, and no body for nobody."""
    _gone(request, e)
    return Response(status_code=CLIENT_CLOSED)


def _usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def _extras(stats: GenerationStats, dropped: int = 0, notice: str | None = None) -> dict:
    return {"dropped_messages": dropped, "notice": notice, "tokens_per_s": stats.tokens_per_s,
            "time_to_first_token_s": stats.time_to_first_token_s, "invalid_bytes": stats.invalid_bytes}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _in_band_error(e: ValueError) -> str:
    """A mistake found mid-stream: the headers are gone, so it is reported in-band, as OpenAI does."""
    return _sse({"error": {"message": " ".join(str(e).split()), "type": "invalid_request_error"}})


@dataclass
class Routes:
    """The handlers of one app, over its backend; `scheduler` owns the generations (and their probe)."""

    backend: Backend
    cfg: ServerConfig
    scheduler: Scheduler
    created: int = field(default_factory=lambda: int(time.time()))
    pairs: Pairs | None = None  # base+adapter pairs (serving.lora_pairs): a request's "adapter" picks one

    @property
    def probe(self) -> GenerationProbe:
        return self.scheduler.probe

    async def health(self) -> dict:
        return {"status": "ok", "backend": self.backend.name, "model": self.cfg.model_id, "n_ctx": self.backend.n_ctx,
                "generations": self.probe.snapshot(), "max_waiting": self.scheduler.max_waiting}

    async def models(self) -> dict:
        """The model; with LoRA adapters, each base+adapter pair (the base alone included, where it can be had)
        with what a request's "adapter" field says to get it."""
        if self.pairs is None:
            return {"object": "list", "data": [{"id": self.cfg.model_id, "object": "model", "created": self.created,
                                                "owned_by": "prodip"}]}
        return {"object": "list", "data": [{"id": p["id"], "object": "model", "created": self.created,
                                            "owned_by": "prodip", "prodip": p} for p in self.pairs.listing()]}

    def _pair(self, adapter: str | None) -> tuple[Backend, str]:
        """The backend answering for `adapter` (checked by adapter_from_body) and the model id to report."""
        if self.pairs is None:
            return self.backend, self.cfg.model_id
        view = self.pairs.view(self.backend, adapter)
        return view, view.name

    async def _parse(self, request: Request, chat: bool) -> tuple[GenerationRequest, bool, float]:
        """One body read and checked: (its GenerationRequest, stream mode, arrival time). The checks run
        on a worker thread (CPU only, they wait for nothing): a 1 MiB body of 30,000 messages takes ~1 s
        to parse and check, which would stall every stream on the event loop."""
        arrived = time.perf_counter()
        raw = await read_body(request, self.cfg.max_body_bytes)

        def check() -> tuple[GenerationRequest, bool]:
            body = parse_body(raw)
            adapters = tuple(self.pairs.pairs) if self.pairs else ()
            return request_from_body(body, chat, self.cfg.max_tokens_cap, adapters), stream_flag(body)

        return (*await anyio.to_thread.run_sync(check), arrived)

    async def _start(self, request: Request, req: GenerationRequest, arrived: float):
        """Queue the request's generation on the pair its adapter picks and wait for its turn: (the job,
        the model id to report, the prepared chat or None). The job is the stream's turn (given to it)."""
        backend, model_id = self._pair(req.adapter)
        job = self.scheduler.submit(lambda turn: open_stream(backend, req, turn), arrived)
        return job, model_id, await self.scheduler.start(job, request.is_disconnected)

    async def _whole(self, request: Request, job: Job) -> str:
        """A non-streamed reply, gathered while the client stays (a hang-up stops the generation)."""
        return "".join([piece async for piece in self.scheduler.pieces(job, request.is_disconnected)])

    async def _streamed(self, request: Request, job: Job) -> AsyncIterator[str]:
        """A streamed reply's pieces. A hang-up (noticed here, or the server cancelling the response)
        ends the stream quietly: the headers are gone, so no handler can answer it; one log line."""
        gone: str | None = "the client disconnected mid-stream"
        try:
            async for piece in self.scheduler.pieces(job, request.is_disconnected):
                yield piece
            gone = None
        except ClientGone as e:
            gone = str(e)
        except ValueError:  # the model's mistake, reported in-band by the caller
            gone = None
            raise
        finally:
            if gone:
                _gone(request, ClientGone(gone))

    async def chat_completions(self, request: Request) -> Response:
        req, stream_mode, arrived = await self._parse(request, chat=True)
        job, model_id, prepared = await self._start(request, req, arrived)
        stream: TextStream = job.stream
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        headers = {"X-Prodip-Dropped-Messages": str(prepared.dropped)}
        if not stream_mode:
            text = await self._whole(request, job)
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
                async for piece in self._streamed(request, job):
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
        req, stream_mode, arrived = await self._parse(request, chat=False)
        job, model_id, _ = await self._start(request, req, arrived)
        stream: TextStream = job.stream
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": model_id,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if not stream_mode:
            out = choice(await self._whole(request, job), stream.stats.finish_reason)
            out["usage"] = _usage(stream.stats)
            out["prodip"] = _extras(stream.stats)
            return JSONResponse(out)

        async def events() -> AsyncIterator[str]:
            try:
                async for piece in self._streamed(request, job):
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

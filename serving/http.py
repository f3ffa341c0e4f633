"""An OpenAI-compatible HTTP server over one Backend: /v1/chat/completions and /v1/completions
(with SSE streaming), /v1/models and /health. FastAPI + uvicorn, bound to 127.0.0.1 by default.

Exposure limits: the request body is capped (413), max_tokens is capped (400), and every client
mistake (invalid UTF-8 or JSON, a bad sampling parameter, a prompt longer than the context) is a
400 with a one-line message in OpenAI's error shape. One generation runs at a time per backend
(llama.cpp contexts are not re-entrant); other requests wait their turn, counted by a
`GenerationProbe` (`app.state.generations`, also in /health). A client that hangs up mid-stream ends
its generation: the stream is closed, which closes the backend's token loop.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serving.backend import Backend, SamplingParams, ServingError
from serving.chat_session import GenerationProbe, GenerationStats, chat_stream, completion_stream

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any context we serve
DEFAULT_MAX_TOKENS_CAP = 2048
DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
SSE_DONE = "data: [DONE]\n\n"


class RequestError(ServingError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class ServerConfig:
    model_id: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP


def parse_bind(spec: str) -> tuple[str, int]:
    """'[HOST:]PORT' -> (host, port); the host defaults to loopback."""
    host, _, port = spec.rpartition(":")
    host = host.strip("[]") or DEFAULT_HOST
    try:
        p = int(port)
    except ValueError:
        raise ServingError(f"--http expects [HOST:]PORT, got {spec!r}") from None
    if not 0 <= p <= 65535:
        raise ServingError(f"port must be in [0, 65535], got {p}")
    return host, p


def error_body(message: str, status: int) -> JSONResponse:
    one_line = " ".join(str(message).split())
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": one_line, "type": kind, "param": None, "code": None}}, status_code=status)


async def read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body is {declared} bytes; the limit is {limit}", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(f"request body exceeds the {limit}-byte limit", 413)
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(obj, dict):
        raise RequestError("request body must be a JSON object")
    return obj


def _text(v: object, name: str) -> str:
    if not isinstance(v, str):
        raise RequestError(f"{name} must be a string")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # JSON can smuggle lone surrogates ("\ud800") past the UTF-8 check
        raise RequestError(f"{name} is not valid UTF-8 (lone surrogate)") from None
    return v


def _number(body: dict, key: str, default: float, *, integer: bool = False) -> float | int:
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise RequestError(f"{key} must be {'an integer' if integer else 'a number'}, got {v!r}")
    return v


def sampling_from_body(body: dict, cap: int) -> SamplingParams:
    """OpenAI fields plus llama.cpp-style extensions (top_k, repeat_penalty / repetition_penalty)."""
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("only n=1 is supported")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, min(DEFAULT_MAX_TOKENS, cap), integer=True)
    if not 1 <= max_tokens <= cap:
        raise RequestError(f"{key} must be in [1, {cap}], got {max_tokens}")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (_text(stop, "stop"),)
    elif isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS:
        stops = tuple(_text(s, "stop") for s in stop)
    else:
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
    rep_key = "repetition_penalty" if body.get("repetition_penalty") is not None else "repeat_penalty"
    defaults = SamplingParams()
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise RequestError(f"seed must be a non-negative integer, got {seed!r}")
    params = SamplingParams(
        max_new_tokens=int(max_tokens),
        temperature=_number(body, "temperature", defaults.temperature),
        top_k=_number(body, "top_k", defaults.top_k, integer=True),
        top_p=_number(body, "top_p", defaults.top_p),
        repetition_penalty=_number(body, rep_key, defaults.repetition_penalty),
        seed=seed,
        stop=stops,
    )
    try:
        return params.validate()
    except ServingError as e:
        raise RequestError(str(e)) from None


def _stream_flag(body: dict) -> bool:
    s = body.get("stream", False)
    if not isinstance(s, bool):
        raise RequestError("stream must be true or false")
    return s


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported")
            content = "".join(_text(p.get("text"), f"messages[{i}].content") for p in content)
        out.append({"role": m.get("role"), "content": _text(content, f"messages[{i}].content")})
    return out


def _prompt(body: dict) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1:
        p = p[0]
    if not isinstance(p, str):
        raise RequestError("prompt must be a string (or a list holding one string)")
    return _text(p, "prompt")


def _usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def _extras(stats: GenerationStats, dropped: int = 0, notice: str | None = None) -> dict:
    return {"dropped_messages": dropped, "notice": notice, "tokens_per_s": stats.tokens_per_s,
            "time_to_first_token_s": stats.time_to_first_token_s}


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


def create_app(backend: Backend, config: ServerConfig | None = None, lock: threading.Lock | None = None) -> FastAPI:
    # Long on purpose: FastAPI routes are closures over this app's backend, lock and probe; each
    # handler below is short, and splitting them across module-level factories would hide that state.
    cfg = config or ServerConfig(model_id=backend.name)
    lock = lock or threading.Lock()
    probe = GenerationProbe()  # counted under the lock: at most one active generation, ever
    app = FastAPI(title="prodip", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.generations = probe
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return error_body(str(e), e.status)

    @app.exception_handler(ValueError)  # ServingError, ChatError, PromptTooLong, TokenizerError
    async def _value_error(_: Request, e: ValueError) -> JSONResponse:
        return error_body(str(e), 400)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "backend": backend.name, "model": cfg.model_id, "n_ctx": backend.n_ctx,
                "generations": probe.snapshot()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": cfg.model_id, "object": "model", "created": created,
                                            "owned_by": "prodip"}]}

    def _locked(fn, *args):
        with lock:
            return fn(*args)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request, cfg.max_body_bytes)
        messages = _messages(body)
        params = sampling_from_body(body, cfg.max_tokens_cap)
        stream_mode = _stream_flag(body)
        arrived = time.perf_counter()
        prepared, stream = await anyio.to_thread.run_sync(_locked, chat_stream, backend, messages, params)
        stream.lock, stream.probe, stream.stats.queued_at = lock, probe, arrived
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        headers = {"X-Prodip-Dropped-Messages": str(prepared.dropped)}
        if not stream_mode:
            text = await anyio.to_thread.run_sync(lambda: "".join(stream))
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": now, "model": cfg.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": stream.stats.finish_reason}],
                "usage": _usage(stream.stats),
                "prodip": _extras(stream.stats, prepared.dropped, prepared.notice)}, headers=headers)

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": cfg.model_id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        async def events() -> AsyncIterator[str]:
            yield _sse(chunk({"role": "assistant", "content": ""}))
            try:
                async for piece in _pull(iter(stream)):
                    yield _sse(chunk({"content": piece}))
            except ValueError as e:  # headers are gone: report in-band, as OpenAI does
                yield _sse({"error": {"message": " ".join(str(e).split()), "type": "invalid_request_error"}})
                return
            last = chunk({}, stream.stats.finish_reason)
            last["usage"] = _usage(stream.stats)
            last["prodip"] = _extras(stream.stats, prepared.dropped, prepared.notice)
            yield _sse(last)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, cfg.max_body_bytes)
        prompt = _prompt(body)
        params = sampling_from_body(body, cfg.max_tokens_cap)
        stream_mode = _stream_flag(body)
        arrived = time.perf_counter()
        stream = await anyio.to_thread.run_sync(_locked, completion_stream, backend, prompt, params)
        stream.lock, stream.probe, stream.stats.queued_at = lock, probe, arrived
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": cfg.model_id,
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
                yield _sse({"error": {"message": " ".join(str(e).split()), "type": "invalid_request_error"}})
                return
            last = choice("", stream.stats.finish_reason)
            last["usage"] = _usage(stream.stats)
            last["prodip"] = _extras(stream.stats)
            yield _sse(last)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve(backend: Backend, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, config: ServerConfig | None = None,
          log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(create_app(backend, config), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)

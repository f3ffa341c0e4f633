"""An OpenAI-compatible HTTP server over one Backend: /v1/chat/completions and /v1/completions
(with SSE streaming), /v1/models and /health. FastAPI + uvicorn, bound to 127.0.0.1 by default.

Fail before announcing: `reserve_socket(host: str, port: int, *, flag="--http") -> socket.socket`
resolves the host, binds and listens on the port, or raises ServingError with one line naming `flag`
(a busy port, a host that does not resolve, an address not of this machine, a port out of range).
`bound_port(sock)` is the port it holds (the OS's pick for 0). The server is handed that very socket
(`serve(..., sock=sock)`), so nothing can take the port between the check and the serving; a server
that takes only a port (Gradio, in demo/) closes it just before it binds the same port itself.

Exposure limits: the request body is capped (413), max_tokens is capped (400), and every client
mistake (invalid UTF-8 or JSON, a bad sampling parameter, a prompt longer than the context) is a
400 with a one-line message in OpenAI's error shape. One generation runs at a time per backend
(llama.cpp contexts are not re-entrant); other requests wait their turn, counted by a
`GenerationProbe` (`app.state.generations`, also in /health). A client that hangs up mid-stream ends
its generation: the stream is closed, which closes the backend's token loop.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serving.backend import (
    Backend,
    MaxNewTokens,
    RepetitionPenalty,
    SamplingParams,
    SamplingSeed,
    ServingError,
    Temperature,
    TopK,
    TopP,
)
from serving.chat_session import GenerationProbe, GenerationStats, chat_stream, completion_stream
from training.records import JSONBoundError, loads
from training.schema import Port, SchemaError, check, parse, reject_unknown

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any context we serve
DEFAULT_MAX_TOKENS_CAP = 2048
DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
SSE_DONE = "data: [DONE]\n\n"
LISTEN_BACKLOG = 2048  # uvicorn's default
# request-body fields: any other is refused with the nearest name, so a typo ("temprature") is not ignored
SAMPLING_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_k", "top_p", "repetition_penalty",
                   "repeat_penalty", "seed", "stop", "stream")
CHAT_FIELDS, COMPLETION_FIELDS = ("messages",), ("prompt",)
IGNORED_FIELDS = ("model", "user", "stream_options", "metadata", "store")  # labels: they change no output
NOOP_AT = {"n": (None, 1), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
           "logprobs": (None, False), "echo": (None, False), "best_of": (None, 1)}  # allowed only at these


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
    """'[HOST:]PORT' -> (host, port); the host defaults to loopback, the port is a schema Port."""
    host, _, port = spec.rpartition(":")
    host = host.strip("[]") or DEFAULT_HOST
    if not port.strip().isdigit():
        raise ServingError(f"--http expects [HOST:]PORT, got {spec!r}")
    try:
        return host, parse(Port, port, "--http port")
    except SchemaError as e:
        raise ServingError(str(e)) from None


def reserve_socket(host: str, port: int, *, flag: str = "--http") -> socket.socket:
    """A TCP socket bound to (host, port), ready to hand to the server, or ServingError naming `flag`.

    Done before the model loads and before "serving on ..." is printed, so a busy port or a bad host
    fails at once with one line instead of after minutes of loading (or, worse, after announcing)."""
    where = f"{flag} {host}:{port}"
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ServingError(f"{where}: port must be an integer in [0, 65535]")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ServingError(f"{where}: cannot resolve host {host!r} ({getattr(e, 'strerror', None) or e})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    # as uvicorn does: restarting right after a stop must not wait out TIME_WAIT (still refuses a live listener)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = {errno.EADDRINUSE: f"port {port} is already in use",
               errno.EADDRNOTAVAIL: f"{host!r} is not an address of this machine",
               errno.EACCES: f"no permission to bind port {port}"}.get(e.errno, e.strerror or str(e))
        raise ServingError(f"{where}: {why}") from None
    sock.listen(LISTEN_BACKLOG)  # held from now on: a bound socket that is not listening can be bound twice
    sock.set_inheritable(True)
    return sock


def bound_port(sock: socket.socket) -> int:
    """The port a reserved socket holds (the OS's pick when 0 was asked for)."""
    return sock.getsockname()[1]


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
        obj = loads(text)  # the one bounded JSON reader: nesting depth, lone surrogates (training.records)
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except JSONBoundError as e:
        raise RequestError(f"request body: {e}") from None
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


def _field(body: dict, key: str, type_: object, default: object) -> object:
    """body[key] checked against the schema type shared with SamplingParams and the CLI flags."""
    v = body.get(key)
    if v is None:
        return default
    try:
        return check(type_, v, key, strict=True)
    except SchemaError as e:
        raise RequestError(str(e)) from None


def check_fields(body: dict, endpoint_fields: tuple[str, ...]) -> None:
    """Refuse a misspelt or unsupported field (nearest name suggested) instead of ignoring it; OpenAI's
    fields that change nothing here are accepted at their no-op value only."""
    for key, noop in NOOP_AT.items():
        if body.get(key) not in noop:
            raise RequestError(f"{key} = {json.dumps(body[key])} is not supported: only {key}={json.dumps(noop[-1])}")
    try:
        reject_unknown("field", body, (*endpoint_fields, *SAMPLING_FIELDS, *IGNORED_FIELDS, *NOOP_AT))
    except SchemaError as e:
        raise RequestError(str(e)) from None


def sampling_from_body(body: dict, cap: int) -> SamplingParams:
    """OpenAI fields plus llama.cpp-style extensions (top_k, repeat_penalty / repetition_penalty)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, key, MaxNewTokens, min(DEFAULT_MAX_TOKENS, cap))
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
    d = SamplingParams()
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_field(body, "temperature", Temperature, d.temperature),
        top_k=_field(body, "top_k", TopK, d.top_k),
        top_p=_field(body, "top_p", TopP, d.top_p),
        repetition_penalty=_field(body, rep_key, RepetitionPenalty, d.repetition_penalty),
        seed=_field(body, "seed", SamplingSeed, None),
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
        check_fields(body, CHAT_FIELDS)
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
        check_fields(body, COMPLETION_FIELDS)
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
          log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Serve until stopped; on `sock` (from reserve_socket) when given, else bind (host, port) now."""
    import uvicorn

    sock = sock or reserve_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(create_app(backend, config), host=host, port=bound_port(sock),
                                           log_level=log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()

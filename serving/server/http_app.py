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
(llama.cpp contexts are not re-entrant), on the app's one generation thread (serving.server.scheduler, the
only place that decides whose turn it is); other requests wait their turn in a bounded queue without
holding a thread (`ServerConfig.max_waiting` of them, each at most `wait_s`), and beyond that get a
503 with Retry-After. Generations are counted by a `GenerationProbe` (`app.state.generations`, also
in /health). A client that hangs up frees its place in the queue, or ends its generation at the next
token; one that hangs up mid-body is one log line.

The routes are serving.server.http_routes' (one `Routes` per app); what a request body may say is checked
by serving.server.http_requests.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import AsyncIterator

from fastapi import FastAPI

from serving.backend import Backend, ServingError
from serving.lora_pairs import Pairs
from serving.server.http_requests import RequestError, ServerConfig
from serving.server.http_routes import Routes, busy, client_gone, request_error, value_error
from serving.server.scheduler import Busy, ClientGone, Scheduler
from training.runfiles.schema import Port, SchemaError, parse

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ServerConfig", "bound_port", "create_app", "parse_bind",
           "reserve_socket", "serve"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
LISTEN_BACKLOG = 2048  # uvicorn's default


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


def create_app(backend: Backend, config: ServerConfig | None = None) -> FastAPI:
    """The app over `backend`: its routes share one Scheduler (one generation thread, a bounded queue),
    the owner of its turns and of their GenerationProbe (`app.state.generations`: at most one active)."""
    cfg = config or ServerConfig(model_id=backend.name)
    scheduler = Scheduler(max_waiting=cfg.max_waiting, wait_s=cfg.wait_s)
    routes = Routes(backend, cfg, scheduler, pairs=Pairs.of(backend))  # LoRA pairs, listed and picked per request

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.close()  # the waiting requests are answered 503, the running generation ends

    app = FastAPI(title="prodip", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.generations = scheduler.probe
    app.state.scheduler = scheduler
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(ValueError, value_error)
    app.add_exception_handler(Busy, busy)
    app.add_exception_handler(ClientGone, client_gone)
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.post("/v1/completions")(routes.completions)
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

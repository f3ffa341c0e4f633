"""`python -m serving RUN --web [--port P]`: the web export (RUN/export/web, `python -m export web`) served
on 127.0.0.1 by Starlette's StaticFiles under uvicorn, with the headers WebAssembly threads need
(a cross-origin-isolated page: COOP same-origin + COEP require-corp) and the MIME types the browser
checks (.wasm application/wasm for streaming compilation, .mjs/.js text/javascript for module scripts).
Any static host serves the folder as well, given these headers (docs/web.md)."""

from __future__ import annotations

import mimetypes
from pathlib import Path

from serving.backend import ServingError
from training.runfiles import layout

WEB_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp",
               "Cross-Origin-Resource-Policy": "same-origin", "Cache-Control": "no-cache"}
MIME_TYPES = {".wasm": "application/wasm", ".mjs": "text/javascript", ".js": "text/javascript",
              ".json": "application/json", ".md": "text/markdown", ".gguf": "application/octet-stream",
              ".onnx": "application/octet-stream", ".onnx_data": "application/octet-stream"}
DEFAULT_WEB_PORT = 8080


def web_dir_of(model: str | Path) -> Path:
    """RUN/export/web (RUN given), EXPORT/web (the export folder given) or the site folder itself."""
    p = Path(model)
    for cand in (p / layout.EXPORT / layout.WEB_DIR, p / layout.WEB_DIR, p):
        if (cand / "index.html").is_file() and (cand / "prodip-web.json").is_file():
            return cand
    raise ServingError(f"{p}: holds no web export (RUN/export/web/index.html); run `python -m export web {p}` first")


def create_web_app(folder: Path):
    """The Starlette app: the folder's files, each answer with WEB_HEADERS."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Mount
    from starlette.staticfiles import StaticFiles
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    for ext, mime in MIME_TYPES.items():  # StaticFiles' FileResponse guesses types through mimetypes
        mimetypes.add_type(mime, ext)

    class Headers:
        """Adds WEB_HEADERS to every answer (files, 404s and redirects alike)."""

        def __init__(self, app: ASGIApp):
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            async def send_with(message: Message) -> None:
                if message["type"] == "http.response.start":
                    extra = [(k.lower().encode(), v.encode()) for k, v in WEB_HEADERS.items()]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await send(message)

            await self.app(scope, receive, send_with)

    return Starlette(routes=[Mount("/", StaticFiles(directory=folder, html=True))], middleware=[Middleware(Headers)])


def serve_web(model: str | Path, host: str = "127.0.0.1", port: int | None = None) -> None:
    """Serve the web export until interrupted; prints the URL first."""
    import sys

    import uvicorn

    from serving.server.http_app import bound_port, reserve_socket

    folder = web_dir_of(model)
    sock = reserve_socket(host, DEFAULT_WEB_PORT if port is None else port, flag="--port")
    print(f"serving the web export {folder} on http://{host}:{bound_port(sock)}/ (index.html: wllama"
          f"{', onnx.html: onnxruntime-web' if (folder / 'onnx.html').is_file() else ''}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(create_web_app(folder), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


WEB_FLAGS = ("model", "web", "port", "debug")


def serve_web_flags(args, defaults) -> None:
    """`python -m serving MODEL --web [--port P]`: other flags (a model runtime's) are refused by name."""
    if not args.web:
        raise ServingError("--port applies to --web (an OpenAI-compatible API takes --http [HOST:]PORT)")
    given = [k for k, v in vars(args).items() if k not in WEB_FLAGS and v != getattr(defaults, k, None)]
    if given:
        raise ServingError(f"--{given[0].replace('_', '-')} does not apply to --web: the page runs the model in "
                           "the browser, with its own settings")
    serve_web(args.model, port=args.port)

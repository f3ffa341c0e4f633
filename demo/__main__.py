"""python -m demo [--model PATH] [--host HOST] [--port PORT] [--share]

Without --model: the quickstart's model (runs/quickstart/chat/export/gguf/*-Q4_K_M.gguf, else the
quickstart run's latest checkpoint), looked up under the current folder, then $PRODIP_HOME.
Numbers are checked by training.runfiles.schema, and the address is bound before anything loads: a bad
host or a busy port is one `error:` line naming the flag, not a stack trace after the model loaded.
"""

from __future__ import annotations

import argparse
import sys

from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.schema import Port, PositiveInt, flag
from training.store.urls import local_path

HOST_PORT_FLAGS = "--host/--port"


def build_parser() -> argparse.ArgumentParser:
    from demo.models import DEFAULT_HOST, DEFAULT_PORT

    ap = ArgumentParser(prog="python -m demo", description="Bangla chat demo (Gradio)")  # one `error:` line
    ap.add_argument("--model", type=local_path, help=".gguf / .onnx / run or checkpoint folder (default: the quickstart's)")
    ap.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST}: this machine only)")
    ap.add_argument("--port", type=flag(Port), default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0 = any free port")
    ap.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    ap.add_argument("--threads", type=flag(PositiveInt), help="CPU threads per model")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def run(args: argparse.Namespace) -> None:
    from demo.models import default_model, discover_models
    from serving.server.http_app import bound_port, reserve_socket

    model = args.model if args.model is not None else default_model()
    entries = discover_models(model)  # before importing Gradio: a missing model is reported at once
    # Hold the address while the model loads: a bad host or busy port fails now, in one line. Gradio
    # binds it itself, so it is let go just before the launch (port 0: the OS's pick is kept).
    sock = reserve_socket(args.host, args.port, flag=HOST_PORT_FLAGS)
    pool = None
    try:
        port = bound_port(sock)
        from demo.app import build_app, launch

        app, pool = build_app(entries, threads=args.threads)
        pool.get(entries[0].label)  # load the default now: a broken model fails here, not on first message
        print(f"models: {', '.join(e.label for e in entries)}", file=sys.stderr)
        sock.close()
        launch(app, host=args.host, port=port, share=args.share, block=True)
    finally:
        sock.close()
        if pool is not None:
            pool.close()


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), argv, run)


if __name__ == "__main__":
    sys.exit(main())

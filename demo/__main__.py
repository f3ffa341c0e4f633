"""python -m demo [--model PATH] [--host HOST] [--port PORT] [--share]

Without --model: the quickstart's model (runs/quickstart/chat/export/gguf/*-Q4_K_M.gguf, else the
quickstart run's latest checkpoint), looked up under the current folder, then $PRODIP_HOME.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from training.cli import guarded


def build_parser() -> argparse.ArgumentParser:
    from demo.models import DEFAULT_HOST, DEFAULT_PORT

    ap = argparse.ArgumentParser(prog="python -m demo", description="Bangla chat demo (Gradio)")
    ap.add_argument("--model", type=Path, help=".gguf / .onnx / run or checkpoint folder (default: the quickstart's)")
    ap.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST}: this machine only)")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    ap.add_argument("--threads", type=int, help="CPU threads per model")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def run(args: argparse.Namespace) -> None:
    from demo.models import default_model, discover_models

    model = args.model if args.model is not None else default_model()
    entries = discover_models(model)  # before importing Gradio: a missing model is reported at once
    from demo.app import build_app, launch

    app, pool = build_app(entries, threads=args.threads)
    pool.get(entries[0].label)  # load the default now: a broken model fails here, not on first message
    print(f"models: {', '.join(e.label for e in entries)}", file=sys.stderr)
    try:
        launch(app, host=args.host, port=args.port, share=args.share, block=True)
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return guarded(lambda: run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())

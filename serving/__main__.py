"""python -m serving MODEL [--backend B] [--prompt TEXT | --http [HOST:]PORT] [sampling options]

Without --prompt or --http: an interactive streaming chat in the terminal (/reset starts over,
/quit or Ctrl-D leaves). MODEL is a .gguf file, an .onnx file (or its folder) or a training run /
checkpoint folder.
"""

from __future__ import annotations

import argparse
import sys

from serving import RUNTIMES, describe, load
from serving.backend import (
    MaxNewTokens,
    RepetitionPenalty,
    SamplingParams,
    SamplingSeed,
    Temperature,
    TopK,
    TopP,
)
from serving.chat_session import ChatSession, TextStream, completion_stream
from serving.flags import backend_name
from serving.http import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS_CAP,
    ServerConfig,
    bound_port,
    parse_bind,
    reserve_socket,
    serve,
)
from training.cli import ArgumentParser, run_main
from training.schema import PositiveInt, flag

PROMPT_MARK = ">>> "
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help=".gguf file, .onnx file/folder, or a run/checkpoint folder")
    ap.add_argument("--backend", type=backend_name, metavar="BACKEND",
                    help=f"force a runtime: {', '.join(RUNTIMES)} (default: from the file)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prompt", help="answer this one message and exit")
    mode.add_argument("--http", metavar="[HOST:]PORT", help="serve an OpenAI-compatible API (host 127.0.0.1 by default)")
    ap.add_argument("--raw", action="store_true", help="with --prompt: plain text completion, no chat template")
    ap.add_argument("--system", help="system prompt for the chat")
    ap.add_argument("--max-tokens", type=flag(MaxNewTokens), default=256)
    ap.add_argument("--temperature", type=flag(Temperature), default=SamplingParams.temperature, help="0 = greedy")
    ap.add_argument("--top-k", type=flag(TopK), default=SamplingParams.top_k, help="0 = off")
    ap.add_argument("--top-p", type=flag(TopP), default=SamplingParams.top_p, help="in (0, 1]; 1 = off")
    ap.add_argument("--repeat-penalty", type=flag(RepetitionPenalty), default=SamplingParams.repetition_penalty)
    ap.add_argument("--seed", type=flag(SamplingSeed))
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--threads", type=flag(PositiveInt), help="CPU threads for the runtime")
    ap.add_argument("--max-body-bytes", type=flag(PositiveInt), default=DEFAULT_MAX_BODY_BYTES,
                    help="HTTP request body cap")
    ap.add_argument("--max-tokens-cap", type=flag(MaxNewTokens), default=DEFAULT_MAX_TOKENS_CAP,
                    help="HTTP max_tokens cap")
    ap.add_argument("--stats", action="store_true", help="print tokens/s after each reply (to stderr)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def _print_stream(stream: TextStream, show_stats: bool) -> None:
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = stream.stats
    if show_stats:
        tps = f"{s.tokens_per_s:.1f} tok/s" if s.tokens_per_s else "n/a tok/s"
        ttft = f"{s.time_to_first_token_s * 1000:.0f} ms" if s.time_to_first_token_s is not None else "n/a"
        print(f"[{s.completion_tokens} tokens, {tps}, first token {ttft}, {s.finish_reason}]", file=sys.stderr)


def _chat_turn(session: ChatSession, text: str, params: SamplingParams, show_stats: bool) -> None:
    prepared, stream = session.ask(text, params)
    if prepared.notice:
        print(f"[note: {prepared.notice}]", file=sys.stderr)
    _print_stream(stream, show_stats)
    session.commit(stream)


def interactive(session: ChatSession, params: SamplingParams, show_stats: bool) -> None:
    print(f"{session.backend.name}: chatting (context {session.backend.n_ctx} tokens). "
          "/reset starts over, /quit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            line = input(PROMPT_MARK)
        except EOFError:
            print(file=sys.stderr)
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/reset":
            session.reset()
            print("[conversation cleared]", file=sys.stderr)
            continue
        try:
            _chat_turn(session, text, params, show_stats)
        except ValueError as e:  # e.g. a message longer than the context: say so, keep chatting
            print(f"error: {e}", file=sys.stderr)


def run(args: argparse.Namespace) -> None:
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repeat_penalty, seed=args.seed,
                            stop=tuple(args.stop)).validate()
    # the port is taken before the model loads (minutes, for a big one) and before anything is announced
    bind = parse_bind(args.http) if args.http else None
    sock = reserve_socket(*bind) if bind else None
    try:
        kwargs = {"threads": args.threads} if args.threads else {}
        backend = load(args.model, backend=args.backend, **kwargs)
    except BaseException:
        if sock:
            sock.close()
        raise
    info = describe(backend)
    if not info.get("prodip", True):  # a GGUF prodip did not write: say what the chats will use
        how = "its own chat template" if info.get("chat_template") else "plain completion (no chat template)"
        print(f"note: {args.model} is a {info.get('arch', '?')} GGUF prodip did not write; chats use {how}",
              file=sys.stderr)
    try:
        if sock:
            host, port = bind[0], bound_port(sock)
            print(f"serving {backend.name} ({args.model}) on http://{host}:{port}/v1", file=sys.stderr)
            if host not in LOOPBACK:
                print(f"note: bound to {host}: other machines can reach this server", file=sys.stderr)
            serve(backend, host, port, ServerConfig(model_id=backend.name, max_body_bytes=args.max_body_bytes,
                                                    max_tokens_cap=args.max_tokens_cap), sock=sock)
        elif args.prompt is not None and args.raw:
            _print_stream(completion_stream(backend, args.prompt, params), args.stats)
        elif args.prompt is not None:
            _chat_turn(ChatSession(backend, args.system), args.prompt, params, args.stats)
        else:
            interactive(ChatSession(backend, args.system), params, args.stats)
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), argv, run)


if __name__ == "__main__":
    sys.exit(main())

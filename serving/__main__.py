"""python -m serving MODEL [--backend B] [--prompt TEXT | --http [HOST:]PORT] [sampling options]

Without --prompt or --http: an interactive streaming chat in the terminal (/reset starts over,
/quit or Ctrl-D leaves). MODEL is a .gguf file, an .onnx file (or its folder) or a training run /
checkpoint folder, or a file of a run's export written back to a store (s3://BUCKET/RUN/export/gguf/
NAME.gguf: pulled into the run's cache, sha256 checked, training.store.remote_run.pull_export). A base model
(pretrained, not chat-tuned, as its run files or GGUF metadata say) completes text instead of
chatting, and says so; --chat applies the chat template anyway, --raw completes text with any
model. --system needs the chat template: with --raw, or with a base model's text completion, it is
refused by name (add --chat to chat with a base model). With --http every request carries its own
sampling fields: the terminal-only flags (sampling, --system, --raw, --chat, --stats) are refused by name.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from serving import RUNTIMES, describe, load
from serving.backend import (
    DEFAULT_MAX_TOKENS,
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
from serving.chat_session import ChatSession, chat_tuned, completion_stream
from serving.flags import backend_name
from serving.lora_flags import add_lora_flags, lora_kwargs
from serving.server.http_app import ServerConfig, bound_port, parse_bind, reserve_socket, serve
from serving.server.http_requests import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS_CAP
from serving.text_stream import TextStream
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.schema import Port, PositiveInt, flag
from training.store.remote_run import is_url, pull_export

PROMPT_MARK = ">>> "
# flags of the terminal modes, and what an HTTP client sends instead (--http refuses them by name)
TERMINAL_ONLY = {"raw": "/v1/completions", "chat": "/v1/chat/completions", "system": "a system message",
                 "stats": "prodip.tokens_per_s in each response", "max_tokens": "max_tokens",
                 "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "repeat_penalty": "repetition_penalty", "seed": "seed", "stop": "stop"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
FLAG_NAMES = {"max_new_tokens": "--max-tokens", "repetition_penalty": "--repeat-penalty", "temperature": "--temperature",
              "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed", "stop": "--stop"}  # SamplingParams' fields


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help=".gguf file, .onnx file/folder, or a run/checkpoint folder; or a file of a run's "
                    "written-back export, s3://BUCKET/RUN/export/gguf/NAME.gguf (pulled, sha256 checked)")
    ap.add_argument("--backend", type=backend_name, metavar="BACKEND",
                    help=f"force a runtime: {', '.join(RUNTIMES)} (default: from the file)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prompt", help="answer this one message and exit")
    mode.add_argument("--http", metavar="[HOST:]PORT", help="serve an OpenAI-compatible API (host 127.0.0.1 by default)")
    mode.add_argument("--web", action="store_true", help="serve MODEL's web export (RUN/export/web: `python -m export "
                      "web`) on 127.0.0.1 with the headers wasm threads need; the chat runs in the browser")
    ap.add_argument("--port", type=flag(Port), help="--web: the port (default 8080; 0 = any free one)")
    text = ap.add_mutually_exclusive_group()
    text.add_argument("--raw", action="store_true", help="plain text completion, no chat template")
    text.add_argument("--chat", action="store_true", help="apply the chat template even to a base model")
    ap.add_argument("--system", help="system prompt for the chat")
    # sampling: None = not given (the default is filled in later), so --http can refuse what it would not use
    ap.add_argument("--max-tokens", type=flag(MaxNewTokens), help=f"default {DEFAULT_MAX_TOKENS}")
    ap.add_argument("--temperature", type=flag(Temperature), help=f"0 = greedy (default {SamplingParams.temperature})")
    ap.add_argument("--top-k", type=flag(TopK), help=f"0 = off (default {SamplingParams.top_k})")
    ap.add_argument("--top-p", type=flag(TopP), help=f"in (0, 1]; 1 = off (default {SamplingParams.top_p})")
    ap.add_argument("--repeat-penalty", type=flag(RepetitionPenalty),
                    help=f"1 = off (default {SamplingParams.repetition_penalty})")
    ap.add_argument("--seed", type=flag(SamplingSeed))
    ap.add_argument("--stop", action="append", help="stop string (repeatable)")
    ap.add_argument("--threads", type=flag(PositiveInt), help="CPU threads for the runtime")
    ap.add_argument("--max-body-bytes", type=flag(PositiveInt), default=DEFAULT_MAX_BODY_BYTES,
                    help="HTTP request body cap")
    ap.add_argument("--max-tokens-cap", type=flag(MaxNewTokens), default=DEFAULT_MAX_TOKENS_CAP,
                    help="HTTP max_tokens cap")
    add_lora_flags(ap)
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
        bad = f", {s.invalid_bytes} invalid byte sequences dropped" if s.invalid_bytes else ""
        print(f"[{s.completion_tokens} tokens, {tps}, first token {ttft}, {s.finish_reason}{bad}]", file=sys.stderr)


def _chat_turn(session: ChatSession, text: str, params: SamplingParams, show_stats: bool) -> None:
    prepared, stream = session.ask(text, params)
    if prepared.notice:
        print(f"[note: {prepared.notice}]", file=sys.stderr)
    _print_stream(stream, show_stats)
    session.commit(stream)


def _repl(banner: str, turn: Callable[[str], None], reset: Callable[[], None] | None = None) -> None:
    """The terminal loop both modes share: one line a turn, /quit or Ctrl-D leaves, /reset (where the
    mode keeps a conversation) starts over; a turn's error (e.g. longer than the context) is said, the loop goes on."""
    print(banner, file=sys.stderr)
    while True:
        try:
            line = input(PROMPT_MARK)
        except EOFError:
            print(file=sys.stderr)
            return
        text = line.strip()
        if text in ("/quit", "/exit"):
            return
        if text == "/reset":
            if reset is not None:
                reset()
                print("[conversation cleared]", file=sys.stderr)
            continue
        if not text:
            continue
        try:
            turn(text)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)


def interactive(session: ChatSession, params: SamplingParams, show_stats: bool) -> None:
    _repl(f"{session.backend.name}: chatting (context {session.backend.n_ctx} tokens). "
          "/reset starts over, /quit or Ctrl-D leaves.",
          lambda text: _chat_turn(session, text, params, show_stats), session.reset)


def check_http_flags(args: argparse.Namespace) -> None:
    """--http serves requests that carry their own settings: a terminal-only flag would be silently
    dropped, so it is refused, naming the flag and what a request sends instead."""
    given = [k for k in TERMINAL_ONLY if getattr(args, k) is not None and getattr(args, k) is not False]  # 0 is given
    if given:
        k = given[0]
        raise ServingError(f"--{k.replace('_', '-')} does not apply to --http: each request sends its own "
                           f"({TERMINAL_ONLY[k]}); use it with --prompt or the terminal chat")


def check_raw_flags(args: argparse.Namespace) -> None:
    """A plain completion has no system prompt: --system with --raw would be dropped, so it is refused."""
    if args.raw and args.system is not None:
        raise ServingError("--system does not apply to --raw: a plain text completion has no system prompt; "
                           "leave out one of them")


def sampling(args: argparse.Namespace) -> SamplingParams:
    """The flags' settings (each parsed by its schema type), checked by SamplingParams as they enter;
    a flag not given keeps the default."""
    return SamplingParams.from_user(
        FLAG_NAMES, max_new_tokens=DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repeat_penalty,
        seed=args.seed, stop=tuple(args.stop or ()))


def use_chat(args: argparse.Namespace, backend: Backend) -> bool:
    """Chat template or plain completion: --raw / --chat decide; else a base model completes text
    (and says so in one line; --system, which only a chat can use, is refused), a chat-tuned or unknown
    one chats."""
    if args.raw or args.chat:
        return args.chat
    if chat_tuned(backend, args.model) is False:
        if args.system is not None:  # it used to be dropped without a word here
            raise ServingError(f"--system needs the chat template, but {args.model} is a base model (pretrained, "
                               "not chat-tuned) that completes your text as written; add --chat to apply the "
                               "template anyway, or leave out --system")
        print(f"note: {args.model} is a base model (pretrained, not chat-tuned): completing your text as written; "
              "--chat applies the chat template anyway", file=sys.stderr)
        return False
    return True


def complete_interactive(backend: Backend, params: SamplingParams, show_stats: bool) -> None:
    _repl(f"{backend.name}: completing text (context {backend.n_ctx} tokens), each line on its own. "
          "/quit or Ctrl-D leaves.",
          lambda text: _print_stream(completion_stream(backend, text, params), show_stats))


def run(args: argparse.Namespace) -> None:
    if args.web or args.port is not None:
        from serving.server.web_host import serve_web_flags

        return serve_web_flags(args, build_parser().parse_args([args.model, "--web"]))
    if args.http:
        check_http_flags(args)
    check_raw_flags(args)
    params = sampling(args)
    if is_url(args.model):  # a file of a run's written-back export: pulled into the run's cache, sha256 checked
        args.model = str(pull_export(args.model, lambda m: print(m, file=sys.stderr)))
    # the port is taken before the model loads (minutes, for a big one) and before anything is announced
    bind = parse_bind(args.http) if args.http else None
    sock = reserve_socket(*bind) if bind else None
    try:
        kwargs = {"threads": args.threads} if args.threads else {}
        kwargs.update(lora_kwargs(args))  # --lora ADAPTER.gguf: applied by llama.cpp at run time
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
            if chat_tuned(backend, args.model) is False:
                print(f"note: {args.model} is a base model (not chat-tuned): /v1/completions continues text; "
                      "/v1/chat/completions applies a chat template it never learned", file=sys.stderr)
            serve(backend, host, port, ServerConfig(model_id=backend.name, max_body_bytes=args.max_body_bytes,
                                                    max_tokens_cap=args.max_tokens_cap), sock=sock)
        elif not use_chat(args, backend):
            if args.prompt is not None:
                _print_stream(completion_stream(backend, args.prompt, params), args.stats)
            else:
                complete_interactive(backend, params, args.stats)
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

"""Serving under load: concurrent multi-turn chat clients against the HTTP server and the Gradio demo.

    python tests/benchmarks/bench_load.py MODEL [--clients 16] [--turns 5] [--max-tokens 16] [--threads 2]

MODEL is a .gguf file (llama.cpp), an .onnx file/folder or a run folder. Both servers run in this
process on 127.0.0.1 (a free port each); every client holds its own conversation (the history grows
turn by turn, streamed and plain replies alternate on HTTP). Prints a Markdown table: requests,
errors, p50/p95/max latency per turn, generated tokens/s across all clients, RSS before/after and
peak, and the most requests ever inside the llama.cpp model at once (must be 1). Exit status 1 on
any error, any concurrent entry into llama.cpp, or RSS growth past --max-rss-growth-mb.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for p in (REPO, REPO / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

QUESTIONS = ("আজকের আবহাওয়া কেমন?", "একটি ছোট গল্প বলো।", "সকালে হাঁটার উপকারিতা কী?", "ভাই, ডিমের হালি কত?",
             "আর চিনি?")
KIB = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / KIB
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / KIB  # KiB on Linux


def guard(backend):
    """Count concurrent entries into a llama.cpp model (None for other backends)."""
    from fixtures_reliability import EntryGuard

    if hasattr(backend, "llm"):
        backend.llm = EntryGuard(backend.llm)
        return backend.llm
    return None


def wait_up(url: str, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"error: {url} did not come up")


def run_clients(n: int, turn_fn) -> tuple[list[float], list[str], int, float]:
    """n clients, each calling turn_fn(client, turn, history) -> (history, tokens) for its turns."""
    lat: list[float] = []
    errors: list[str] = []
    tokens = 0
    m = threading.Lock()

    def client(i: int) -> None:
        try:
            turn_fn(i, lat, m, lambda k: _add(k))
        except Exception as e:  # noqa: BLE001 (a load test counts every failure)
            with m:
                errors.append(f"client {i}: {type(e).__name__}: {str(e)[:200]}")

    def _add(k: int) -> None:
        nonlocal tokens
        with m:
            tokens += k

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(client, range(n)))
    return lat, errors, tokens, time.perf_counter() - t0


def bench_http(model: Path, args) -> dict:
    import httpx
    import uvicorn

    from serving import load
    from serving.server.http_app import ServerConfig, create_app

    backend = load(model, threads=args.threads) if args.threads else load(model)
    g = guard(backend)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(backend, ServerConfig(model_id=backend.name)), host="127.0.0.1",
                                        port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/health")
    rss0 = rss_mb()

    def turns(i: int, lat: list, m: threading.Lock, add) -> None:
        history: list[dict] = []
        with httpx.Client(base_url=url, timeout=600) as c:
            for t in range(args.turns):
                history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                stream = t % 2 == 1
                t0 = time.perf_counter()
                r = c.post("/v1/chat/completions", json={"messages": history, "max_tokens": args.max_tokens,
                                                         "temperature": 0.7, "seed": i * 100 + t, "stream": stream})
                r.raise_for_status()
                if stream:
                    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                    if any("error" in e for e in events):
                        raise RuntimeError(f"in-band error: {events}")
                    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
                    n = events[-1]["usage"]["completion_tokens"]
                else:
                    body = r.json()
                    text, n = body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]
                with m:
                    lat.append(time.perf_counter() - t0)
                add(n)
                history.append({"role": "assistant", "content": text or "…"})

    try:
        lat, errors, tokens, wall = run_clients(args.clients, turns)
    finally:
        srv.should_exit = True
        th.join(timeout=30)
        backend.close()
    return summary("HTTP /v1/chat/completions", backend.name, lat, errors, tokens, wall, rss0, g)


def bench_demo(model: Path, args) -> dict:
    from gradio_client import Client

    from demo.app import build_app, launch
    from demo.models import discover_models

    entries = discover_models(model)[:1]
    app, pool = build_app(entries, threads=args.threads)
    backend, _ = pool.get(entries[0].label)
    g = guard(backend)
    url = launch(app, port=free_port(), block=False, quiet=True)
    rss0 = rss_mb()

    def turns(i: int, lat: list, m: threading.Lock, add) -> None:
        c = Client(url, verbose=False, download_files=False, httpx_kwargs={"timeout": 600})
        history: list = []
        for t in range(args.turns):
            t0 = time.perf_counter()
            _, history, status = c.predict(QUESTIONS[t % len(QUESTIONS)], history, entries[0].label, args.max_tokens,
                                           0.7, 40, 0.95, 1.1, i * 100 + t, api_name="/chat")
            with m:
                lat.append(time.perf_counter() - t0)
            if len(history) != 2 * (t + 1):
                raise RuntimeError(f"history has {len(history)} messages after turn {t + 1}")
            digits = [int(w) for w in status.replace("·", " ").split() if w.isdigit()]
            add(digits[0] if digits else 0)

    try:
        lat, errors, tokens, wall = run_clients(args.clients, turns)
    finally:
        app.close()
        pool.close()
    return summary("Gradio demo /chat", backend.name, lat, errors, tokens, wall, rss0, g)


def summary(target: str, backend: str, lat: list[float], errors: list[str], tokens: int, wall: float, rss0: float,
            g) -> dict:
    q = statistics.quantiles(lat, n=20) if len(lat) >= 2 else [float("nan")] * 19
    return {"target": target, "backend": backend, "requests": len(lat) + len(errors), "errors": len(errors),
            "error_samples": errors[:3], "p50_s": statistics.median(lat) if lat else float("nan"), "p95_s": q[18],
            "max_s": max(lat, default=float("nan")), "tokens_per_s": tokens / wall if wall else float("nan"),
            "rss_before_mb": rss0, "rss_after_mb": rss_mb(), "peak_rss_mb": peak_rss_mb(),
            "max_inside_llamacpp": g.max_active if g else None, "llamacpp_entries": g.entries if g else None}


def table(rows: list[dict], args) -> str:
    out = [f"Load: {args.clients} concurrent clients x {args.turns} turns, max_tokens {args.max_tokens}, loopback.", "",
           "| target | backend | requests | errors | p50 s | p95 s | max s | gen tok/s (all) | RSS before→after MB "
           "| peak RSS MB | max inside llama.cpp |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        inside = "n/a" if r["max_inside_llamacpp"] is None else f"{r['max_inside_llamacpp']} ({r['llamacpp_entries']} calls)"
        out.append(f"| {r['target']} | {r['backend']} | {r['requests']} | {r['errors']} | {r['p50_s']:.2f} | "
                   f"{r['p95_s']:.2f} | {r['max_s']:.2f} | {r['tokens_per_s']:.1f} | "
                   f"{r['rss_before_mb']:.0f}→{r['rss_after_mb']:.0f} | {r['peak_rss_mb']:.0f} | {inside} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", choices=("http", "demo"), help="benchmark one target")
    ap.add_argument("--max-rss-growth-mb", type=float, default=500.0)
    args = ap.parse_args(argv)
    if not args.model.exists():
        print(f"error: model not found: {args.model}", file=sys.stderr)
        return 2
    rows = []
    if args.only in (None, "http"):
        rows.append(bench_http(args.model, args))
    if args.only in (None, "demo"):
        rows.append(bench_demo(args.model, args))
    print(table(rows, args))
    bad = [r for r in rows if r["errors"] or (r["max_inside_llamacpp"] or 1) > 1
           or r["rss_after_mb"] - r["rss_before_mb"] > args.max_rss_growth_mb]
    for r in rows:
        for e in r["error_samples"]:
            print(f"error sample ({r['target']}): {e}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

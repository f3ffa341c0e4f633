"""Where wllama's time goes against native llama.cpp (issue #44's speed target): the same Q4_K_M GGUF, 1 thread,
same prompt depth and token count, through

- llama-bench built for AVX2 (scripts/build_llama_tools.sh, what the target compares against), and for narrower
  x86 SIMD from the same llama.cpp source (tests/benchmarks/build_llama_isa.sh: `avx` = 128-bit integer SIMD
  with the 8-bit multiply-add `maddubs`, `sse42` = no AVX, where ggml's K-quant dot products fall back to
  plain C);
- wllama 3.13.0 in headless Chromium through the web export's own hook (bench_browser.GENERATE_JS), its default
  build (wasm64, JSPI), and with --compat its wasm32 build (@wllama/wllama-compat, Asyncify; the page copy
  gets `setCompat` and the worker is forced onto it by hiding `WebAssembly.Suspending`).

Rows are measured interleaved, round after round (the machine is shared: compare within a round), with the
1-minute load average beside each. --profile adds one `perf record -e cpu-clock` run per row: the share of
the generating thread's samples in each function (Chromium's V8 names wasm functions by the module's name
section with --perf-basic-prof), so ggml's kernels can be compared native against wasm directly.

    python tests/benchmarks/bench_wasm_kernels.py RUN [--isa avx2 --isa avx --isa sse42] [--rounds 3]
        [--prompt-tokens 64] [--gen-tokens 32] [--compat DIR] [--profile] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).parent)]

from bench_browser import GENERATE_JS, prompt_text  # noqa: E402
from bench_serving import PROMPT_TEXT, llama_bench_args  # noqa: E402

ISA_CACHE = Path(os.environ.get("PRODIP_LLAMA_ISA_CACHE", Path.home() / ".cache" / "prodip" / "llama-isa"))
ISAS = ("avx2", "avx", "sse42")
COMPAT_PATCH = ("{ suppressNativeLog: true });",
                "{ suppressNativeLog: true });\n  wllama.setCompat({ wasm: url('vendor/wllama-compat/wllama.wasm'), "
                "worker: url('vendor/wllama-compat/wllama.js') });")
PERF_HZ = 1000  # one sample per CPU millisecond
PROFILE_PROMPT = 4  # profile runs decode from a 4-token prompt, so prompt processing stays out of the profile
KERNELS = ("ggml_", "quantize_")  # ggml's compute (not model loading: repack_*, page faults, vocab)
HIDE_JSPI = "delete WebAssembly.Suspending;"  # wllama's needCompat(): no JSPI -> its compat (wasm32) build


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def llama_bench(isa: str) -> Path:
    if isa == "avx2":
        from export.gguf.llama_tools import tool_path

        return Path(tool_path("llama-bench"))
    return ISA_CACHE / isa / "bin" / "llama-bench"


def native_cmd(isa: str, gguf: Path, prompt_tokens: int, gen_tokens: int, reps: int) -> list[str]:
    """bench_serving's llama-bench settings at 1 thread (F16 KV cache, flash attention off, batch 512),
    generation at depth --prompt-tokens."""
    args = llama_bench_args(gguf, 1)
    args[args.index("-r") + 1] = str(reps)
    return [str(llama_bench(isa)), *args, "-p", "0", "-d", str(prompt_tokens), "-n", str(gen_tokens)]


def measure_native(cmd: list[str], perf_out: Path | None = None) -> dict:
    p = subprocess.run([*perf_record(perf_out), "--", *cmd] if perf_out else cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or ["llama-bench failed"])[-1])
    rec = json.loads(p.stdout)[0]
    return {"tps": rec["avg_ts"], "runs": rec["samples_ts"], "n_tokens": (len(rec["samples_ts"]) * rec["n_gen"] + 1)}


def compat_site(web: Path, compat: Path, dest: Path) -> Path:
    """A copy of the web export (big files linked) whose page loads wllama's compat build from its own origin."""
    for item in web.iterdir():
        if item.name not in ("wllama-page.js", "vendor"):
            (dest / item.name).symlink_to(item)
    (dest / "vendor").mkdir()
    for item in (web / "vendor").iterdir():
        (dest / "vendor" / item.name).symlink_to(item)
    (dest / "vendor" / "wllama-compat").symlink_to(compat / "wasm")
    page = (web / "wllama-page.js").read_text(encoding="utf-8")
    if COMPAT_PATCH[0] not in page:
        fail(f"{web / 'wllama-page.js'}: no `new Wllama(...)` line to add setCompat after")
    (dest / "wllama-page.js").write_text(page.replace(COMPAT_PATCH[0], COMPAT_PATCH[1]), encoding="utf-8")
    return dest


def perf_record(out: Path) -> list[str]:
    return ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(PERF_HZ), "-o", str(out)]


@contextlib.contextmanager
def perf_procs(out: Path | None, pids: list[str]):
    """`perf record` of these processes' threads while the block runs (Chromium's renderers: the page's
    main thread and its wasm worker)."""
    if out is None:
        yield
        return
    proc = subprocess.Popen([*perf_record(out), "-p", ",".join(pids)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)  # perf attaches to every thread first
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def measure_wllama(web: Path, text: str, gen_tokens: int, reps: int, *, compat: bool = False,
                   perf_out: Path | None = None, warmup: int | None = None) -> dict:
    """One fresh Chromium on the page at ?threads=1 (COOP/COEP served), a warm-up, then `reps` generations."""
    from playwright.sync_api import sync_playwright

    from export.parity.browser_page import CHROMIUM_ARGS, require_browser, serve_folder

    # --perf-basic-prof writes /tmp/perf-PID.map (read below); V8 would also drop an isolate-*-v8.log per
    # process into the working directory: those go nowhere
    args = CHROMIUM_ARGS + (["--js-flags=--perf-basic-prof --no-logfile-per-isolate --logfile=/dev/null"]
                            if perf_out else [])
    fetched: list[str] = []
    with serve_folder(web) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(require_browser()), args=args, headless=True)
        try:
            page = browser.new_context().new_page()
            if compat:
                page.add_init_script(HIDE_JSPI)
            page.on("request", lambda r: fetched.append(r.url))
            page.goto(base + "index.html?threads=1", wait_until="domcontentloaded", timeout=300_000)
            page.wait_for_function("() => window.prodip !== undefined", timeout=300_000)
            info = page.evaluate("async () => { await window.prodip.ready; return window.prodip.info; }")
            # warm-up, as long as a measured run: V8 compiles hot wasm functions with TurboFan in the background
            # (dynamic tiering), so the first tokens run baseline (Liftoff) code
            page.evaluate(GENERATE_JS, [text, gen_tokens] if warmup is None else [text[:40], warmup])
            procs = browser.new_browser_cdp_session().send("SystemInfo.getProcessInfo")["processInfo"]
            pids = [str(x["id"]) for x in procs if x["type"] == "renderer"]
            with perf_procs(perf_out, pids):
                runs = [page.evaluate(GENERATE_JS, [text, gen_tokens]) for _ in range(reps)]
        finally:
            browser.close()
    wasm = sorted({u.rsplit("/", 2)[-2] for u in fetched if u.endswith("wllama.wasm")})
    if compat != (wasm == ["wllama-compat"]):
        raise RuntimeError(f"the page fetched {wasm} (compat {compat})")
    tps = [r["tokens_per_s"] for r in runs if r["n"] == gen_tokens and r["tokens_per_s"]]
    if not tps:
        raise RuntimeError(f"no run generated {gen_tokens} tokens: {runs}")
    return {"tps": statistics.fmean(tps), "runs": tps, "threads": info.get("threads"),
            "prompt_tokens": runs[0].get("prompt_tokens"), "n_tokens": reps * gen_tokens}


def perf_samples(data: Path, sort: str, *filters: str) -> dict[str, int]:
    """perf's sample count per `sort` key (sym or comm); a wasm function's baseline and optimized code
    (V8's `-liftoff` and `-turbofan` entries) count as one."""
    p = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "-n", "--sort", sort, *filters],
                       capture_output=True, text=True)
    out: dict[str, int] = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) < 3 or not parts[0].endswith("%") or not parts[1].isdigit():
            continue
        name = " ".join(parts[3:] if parts[2] in ("[.]", "[k]") else parts[2:]).removeprefix("JS:")
        if name.endswith(("-liftoff", "-turbofan")):
            name = name.rsplit("-", 2)[0]
        out[name] = out.get(name, 0) + int(parts[1])
    return out


def row_specs(args: argparse.Namespace, gguf: Path, web: Path, compat_web: Path | None) -> list[dict]:
    rows = [{"label": f"llama-bench {isa}", "kind": "native", "isa": isa,
             "cmd": native_cmd(isa, gguf, args.prompt_tokens, args.gen_tokens, args.repetitions)} for isa in args.isa]
    rows.append({"label": "wllama (wasm64, JSPI)", "kind": "wllama", "web": web, "compat": False})
    if args.short_warmup:
        rows.append({"label": "wllama, 2-token warm-up", "kind": "wllama", "web": web, "compat": False, "warmup": 2})
    if compat_web:
        rows.append({"label": "wllama compat (wasm32, Asyncify)", "kind": "wllama", "web": compat_web, "compat": True})
    return rows


def measure(row: dict, args: argparse.Namespace, text: str) -> dict:
    if row["kind"] == "native":
        return measure_native(row["cmd"])
    return measure_wllama(row["web"], text, args.gen_tokens, args.repetitions, compat=row["compat"],
                          warmup=row.get("warmup"))


def report(rows: list[dict], rounds: list[dict]) -> list[str]:
    """Markdown: tok/s and ms/token per round (load average beside), and each row's ratio to every other
    row measured in the same round (median over rounds)."""
    labels = [r["label"] for r in rows]
    out = ["| round | load avg (1 min) | " + " | ".join(labels) + " |", "|---|---|" + "---:|" * len(labels)]
    for i, rd in enumerate(rounds, 1):
        cells = [f"{rd[k]['tps']:.2f} tok/s, {1000 / rd[k]['tps']:.0f} ms" if "tps" in rd.get(k, {}) else "failed"
                 for k in labels]
        out.append(f"| {i} | {' / '.join(f'{x:.1f}' for x in rd['load'])} | " + " | ".join(cells) + " |")
    out += ["", "| ratio (median of rounds) | value | per round |", "|---|---:|---|"]
    pairs = [(a, b) for a in labels for b in labels if a != b and labels.index(a) > labels.index(b)]
    for a, b in pairs:
        xs = [rd[a]["tps"] / rd[b]["tps"] for rd in rounds if "tps" in rd.get(a, {}) and "tps" in rd.get(b, {})]
        if xs:
            out.append(f"| {a} / {b} | {statistics.median(xs):.2f}x | {', '.join(f'{x:.2f}' for x in xs)} |")
    return out


def profile_wllama(row: dict, args: argparse.Namespace, data: Path) -> dict:
    """The wllama row profiled from a short prompt; the next prompt length when wllama 3.13.0 cannot return
    the reply (a random-init model's bytes that are not UTF-8, docs/web.md)."""
    from playwright.sync_api import Error

    for n in range(PROFILE_PROMPT, PROFILE_PROMPT + 8):
        try:
            return measure_wllama(row["web"], prompt_text(args.run, n, PROMPT_TEXT), args.gen_tokens, args.repetitions,
                                  compat=row["compat"], perf_out=data)
        except Error as e:
            if "not UTF-8" not in str(e):
                raise
    raise RuntimeError("every short prompt gave a reply wllama cannot return")


def profile(rows: list[dict], args: argparse.Namespace, work: Path) -> list[str]:
    """One perf-recorded run per row, decoding from a PROFILE_PROMPT-token prompt: CPU milliseconds per
    generated token in each of the top functions of the generating thread (native: llama-bench's own process;
    wllama: the renderer's DedicatedWorker, the wasm thread), and in each of the renderer's busiest threads."""
    out = [f"\nProfiles (perf cpu-clock at {PERF_HZ} Hz; {PROFILE_PROMPT}-token prompt; CPU ms per generated token):"]
    for i, row in enumerate(rows):
        if row.get("warmup"):
            continue
        data, maps = work / f"profile{i}.perf", set(Path("/tmp").glob("perf-*.map"))
        if row["kind"] == "native":
            cmd = native_cmd(row["isa"], Path(row["cmd"][row["cmd"].index("-m") + 1]), PROFILE_PROMPT,
                             args.gen_tokens, args.repetitions)
            res, filters, threads = measure_native(cmd, data), [], {}
        else:
            res = profile_wllama(row, args, data)
            filters, threads = ["--comms", "DedicatedWorker"], perf_samples(data, "comm")
        per = PERF_HZ / 1000 * res["n_tokens"]  # samples per (ms x token)
        ms = 1000 / res["tps"]
        syms = perf_samples(data, "sym", *filters)
        kernels = sum(n for name, n in syms.items() if name.startswith(KERNELS) and name != "ggml_cpu_init")
        out.append(f"\n{row['label']}: {res['tps']:.2f} tok/s = {ms:.1f} ms per token (wall, load "
                   f"{os.getloadavg()[0]:.1f}); CPU ms per token: generating thread {sum(syms.values()) / per:.1f}, "
                   f"of it in ggml's compute functions {kernels / per:.1f}")
        out += [f"  {n / per:7.2f} ms  {name}" for name, n in sorted(syms.items(), key=lambda kv: -kv[1])[:args.top]]
        for name, n in sorted(threads.items(), key=lambda kv: -kv[1])[:4]:
            top = sorted(perf_samples(data, "dso,sym", "--comms", name).items(), key=lambda kv: -kv[1])[:3]
            out.append(f"  {n / per:7.2f} ms  thread {name} (" + "; ".join(f"{k} {v / per:.2f}" for k, v in top) + ")")
        for m in set(Path("/tmp").glob("perf-*.map")) - maps:  # V8's symbol maps (--perf-basic-prof), read above
            m.unlink(missing_ok=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder with export/gguf/*Q4_K_M.gguf and export/web/ (python -m export web)")
    ap.add_argument("--isa", action="append", choices=ISAS, help="native builds to time (default: every one built)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repetitions", type=int, default=2, help="generations per measurement")
    ap.add_argument("--compat", type=Path, metavar="DIR", help="an unpacked @wllama/wllama-compat 3.13.0 (npm pack)")
    ap.add_argument("--short-warmup", action="store_true", help="add a wllama row warmed up on 2 tokens only "
                    "(as bench_browser did before 2026-12-07)")
    ap.add_argument("--profile", action="store_true", help="add a perf profile run per row (needs perf)")
    ap.add_argument("--top", type=int, default=8, help="functions listed per profile")
    ap.add_argument("--json", type=Path, help="write the rounds here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ggufs = sorted((args.run / "export" / "gguf").glob("*Q4_K_M.gguf"))
    web = args.run / "export" / "web"
    if not ggufs or not (web / "index.html").is_file():
        fail(f"{args.run}: needs export/gguf/*Q4_K_M.gguf and export/web/index.html (python -m export gguf RUN --q4; "
             "python -m export web RUN)")
    if args.rounds < 0 or args.gen_tokens < 2 or args.prompt_tokens < 1 or args.repetitions < 1:
        fail("--rounds >= 0, --gen-tokens >= 2, --prompt-tokens >= 1 and --repetitions >= 1")
    args.isa = args.isa or [i for i in ISAS if i == "avx2" or llama_bench(i).is_file()]
    for isa in args.isa:
        if not llama_bench(isa).is_file():
            fail(f"--isa {isa}: {llama_bench(isa)} missing (tests/benchmarks/build_llama_isa.sh {isa})")
    if args.compat and not (args.compat / "wasm" / "wllama.wasm").is_file():
        fail(f"--compat: {args.compat}/wasm/wllama.wasm missing (npm pack @wllama/wllama-compat@3.13.0, untar)")
    if args.profile and shutil.which("perf") is None:
        fail("--profile: perf not found (apt-get install linux-perf)")
    text = prompt_text(args.run, args.prompt_tokens, PROMPT_TEXT)
    with tempfile.TemporaryDirectory(prefix="bench_wasm-") as tmp:
        compat_web = compat_site(web, args.compat.resolve(), Path(tmp)) if args.compat else None
        rows = row_specs(args, ggufs[0], web, compat_web)
        rounds = []
        for i in range(args.rounds):
            rd: dict = {"load": []}
            for row in rows:
                try:
                    rd[row["label"]] = measure(row, args, text)
                except Exception as e:  # noqa: BLE001 (a failed row, playwright's or llama-bench's, is reported, not fatal)
                    rd[row["label"]] = {"error": str(e)}
                rd["load"].append(os.getloadavg()[0])
                print(f"round {i + 1} {row['label']}: {rd[row['label']]} load {rd['load'][-1]:.1f}", file=sys.stderr)
            rounds.append(rd)
        print(f"{ggufs[0].name}, 1 thread, {args.prompt_tokens}-token depth, {args.gen_tokens} new tokens, "
              f"{args.repetitions} runs per measurement, {os.cpu_count()} CPUs\n")
        print("\n".join(report(rows, rounds)))
        if args.profile:
            print("\n".join(profile(rows, args, Path(tmp))))
    if args.json:
        args.json.write_text(json.dumps({"rows": [r["label"] for r in rows], "rounds": rounds}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One serving table: every format of one model, through our Python backends, llama.cpp's own
tools and ONNX Runtime GenAI, printed as Markdown and written as JSON + Markdown.

    python tests/benchmarks/bench_serving.py RUN_DIR [--threads N] [--prompt-tokens 128] [--gen-tokens 64]
        [--only TEXT] [--rounds K] [--out DIR]

Rows, whichever exist:
- our Python path (serving.Backend): PyTorch fp32 (the run's latest checkpoint), ONNX fp32/int8/int4
  (RUN_DIR/export/onnx/), GGUF F16/Q8_0/Q4_K_M through llama-cpp-python (RUN_DIR/export/gguf/);
- llama.cpp's `llama-bench` on the same GGUF files (when scripts/build_llama_tools.sh built it), with
  the settings of our llama.cpp row: same threads, F16 KV cache (llama-bench has no F32 cache, so our
  row runs with kv_f32=False here), flash attention off, batch 512, and generation measured at the same
  depth (-d = the prompt length);
- ONNX Runtime GenAI on RUN_DIR/export/onnx/genai/<variant>/ (export.onnx.genai; when `onnxruntime-genai`
  is installed);
- the browser: RUN_DIR/export/web/'s pages in headless Chromium (wllama on its GGUF, onnxruntime-web on each
  ONNX variant; bench_browser.py), when `python -m export web` wrote them.
Columns: file size, load time, time to first token (a fresh prompt of --prompt-tokens), generation
tokens/s (tg: new tokens after the first, greedy, exactly --gen-tokens of them: end of turn is ignored,
as llama-bench does) at 1 thread and at --threads (default: all cores),
peak RSS, KL / top-1 agreement vs the PyTorch fp32 model on one held-out Bangla window (tool rows run
the same file as the Python row above them, so their quality is that file's), and the 1-minute load
average when each measurement ended. Every measurement runs in its own process (clean peak RSS, no
shared thread pools); ours and llama-bench's are the mean of BENCH_REPETITIONS runs.

Targets: llama.cpp Q4_K_M generates >= 5x as fast as PyTorch fp32; our Python llama.cpp path
generates >= 0.9x raw llama-bench speed on the same file and threads.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench_browser import RUNNERS, browser_formats, measure_browser, prompt_text  # noqa: E402
from bench_serving_table import GGUF_TYPES, table, verdicts  # noqa: E402

PROMPT_TEXT = ("আমাদের গ্রামের পাশ দিয়ে একটি ছোট নদী বয়ে গেছে। বর্ষায় নদী ভরে ওঠে, শীতে শান্ত হয়ে যায়। "
               "সকালবেলা কৃষকেরা মাঠে যায়, ছেলেমেয়েরা স্কুলে যায়, আর মায়েরা রান্নাঘরে ব্যস্ত থাকেন। ")
HELDOUT = REPO / "training" / "assets" / "eval" / "heldout_bn.txt"
ONNX_VARIANTS = {"model.onnx": ("ONNX fp32", "fp32"), "model-int8.onnx": ("ONNX int8", "int8"),
                 "model-int4.onnx": ("ONNX int4", "int4")}
BENCH_REPETITIONS = 3
N_BATCH = 512  # serving.backends.llamacpp_backend's n_batch (and n_ubatch): llama-bench is run with the same
KIB = 1024
OUT_JSON, OUT_MD = "serving-bench.json", "serving-bench.md"
RUNTIME_NAMES = {"torch": "PyTorch", "onnx": "ONNX Runtime (prodip)", "llama.cpp": "llama-cpp-python (prodip)",
                 "llama-bench": "llama-bench (llama.cpp)", "genai": "ONNX Runtime GenAI", **RUNNERS}


# ------------------------------------------------------------------------------------ what exists
def formats(run: Path) -> list[dict]:
    """Every (label, runner, path, bytes, quality source) present in the run."""
    from export.gguf.llama_tools import find_tool
    from export.onnx.genai import GENAI_CONFIG, GENAI_DIR
    from training.checkpoint.checkpoint_io import latest
    from training.runfiles import layout

    out = []
    ck = latest(run)
    if ck is not None:
        out.append({"label": "PyTorch fp32", "runner": "torch", "path": run,
                    "bytes": (ck / layout.MODEL_WEIGHTS).stat().st_size})
    onnx = run / layout.EXPORT / layout.ONNX_DIR
    genai = _has_genai()
    for name, (label, variant) in ONNX_VARIANTS.items():
        f = onnx / name
        if f.is_file():
            size = f.stat().st_size + sum(p.stat().st_size for p in onnx.glob(f"{name}[._]data*"))
            out.append({"label": label, "runner": "onnx", "path": f, "bytes": size})
            g = onnx / GENAI_DIR / variant
            if genai and (g / GENAI_CONFIG).is_file():
                out.append({"label": label, "runner": "genai", "path": g, "bytes": size, "same_as": label})
    bench = find_tool("llama-bench")
    for t in GGUF_TYPES:
        for f in sorted((run / layout.EXPORT / layout.GGUF_DIR).glob(f"*-{t}.gguf")):
            out.append({"label": f"GGUF {t}", "runner": "llama.cpp", "path": f, "bytes": f.stat().st_size})
            if bench is not None:
                out.append({"label": f"GGUF {t}", "runner": "llama-bench", "path": f, "bytes": f.stat().st_size,
                            "same_as": f"GGUF {t}"})
    return out + browser_formats(run, GGUF_TYPES)


def _has_genai() -> bool:
    from importlib.util import find_spec

    return find_spec("onnxruntime_genai") is not None


# ------------------------------------------------------------------------------------ measuring
def prompts(tokenize, prompt_tokens: int, n_ctx: int, gen_tokens: int, n: int) -> list[list[int]]:
    """`n` different prompts of the same length (BOS + the text shifted by one token each): every
    timed run starts from a fresh prompt, so no runtime's prefix cache shortens its first token."""
    length = min(prompt_tokens, n_ctx - gen_tokens - 1)
    text = PROMPT_TEXT
    while len(tokenize(text)) < length + n:
        text += PROMPT_TEXT
    ids = tokenize(text)
    return [[ids[0], *ids[1 + r:length + r]] for r in range(n)]


def quality_window(tokenize, n_ctx: int) -> list[int]:
    return tokenize(HELDOUT.read_text(encoding="utf-8"))[:n_ctx]


def timed_stream(stream) -> tuple[float | None, int, float, float]:
    """(seconds to the first item, items, total seconds, this process's CPU seconds after the first
    item) of an iterator, consumed now."""
    start = time.perf_counter()
    first, n, cpu0 = None, 0, 0.0
    for _ in stream:
        n += 1
        if first is None:
            first, cpu0 = time.perf_counter() - start, time.process_time()
    return first, n, time.perf_counter() - start, time.process_time() - cpu0


def measure_backend(kind: str, path: Path, threads: int, prompt_tokens: int, gen_tokens: int,
                    reference: Path | None) -> dict:
    """Our Python path (runs in the child process)."""
    import numpy as np

    from serving import load
    from serving.backend import SamplingParams
    from training.model.logprobs import kl_rows

    # llama.cpp: an F16 KV cache (llama.cpp's default) rather than the F32 one parity uses for prodip
    # files, because llama-bench has no F32 cache and its row must time the same work
    extra = {"kv_f32": False} if kind == "llama.cpp" else {}
    t0 = time.perf_counter()
    b = load(path, backend=kind, threads=threads, **extra)
    load_s = time.perf_counter() - t0
    # A fixed number of new tokens per run, end of turn ignored, as llama-bench generates: a chat model
    # that ends its turn at once would otherwise time nothing ("stopped after 0"). Every backend reads
    # eos_ids when it generates.
    b.eos_ids = ()
    *runs, warm = prompts(b.tokenize, prompt_tokens, b.n_ctx, gen_tokens, BENCH_REPETITIONS + 1)
    list(b.generate(warm[:8], SamplingParams.greedy(2)))  # warm-up
    ttft, tps, cpu, n_gen = [], [], [], []
    for ids in runs:
        first, n, total, cpu_s = timed_stream(b.generate(ids, SamplingParams.greedy(gen_tokens)))
        n_gen.append(n)
        if first is not None:
            ttft.append(first)
        if n > 1:
            tps.append((n - 1) / (total - first))
            cpu.append(cpu_s / (n - 1))
    r = {"load_s": load_s, "ttft_s": _mean(ttft), "gen_tps": _mean(tps), "n_gen": min(n_gen),
         "gen_tps_runs": tps, "gen_cpu_s_per_token": _mean(cpu)}
    window = quality_window(b.tokenize, b.n_ctx)
    logits = b.logits(window)
    if reference is None:  # the PyTorch row writes the reference
        np.save(Path(os.environ["BENCH_REFERENCE"]), logits)
    else:
        ref = np.load(reference)
        r["kl"] = float(kl_rows(ref, logits).mean())
        r["top1"] = float((ref.argmax(-1) == logits.argmax(-1)).mean())
    b.close()
    return {**r, "peak_rss_bytes": peak_rss_bytes()}


def measure_genai(folder: Path, threads: int, prompt_tokens: int, gen_tokens: int) -> dict:
    """ONNX Runtime GenAI (child process): export.onnx.genai's speed probe on our tokenizer's ids."""
    from export.onnx.genai import GENAI_CONFIG, genai_generate_speed
    from training.text.tokenizer import Tokenizer

    cfg = json.loads((folder / GENAI_CONFIG).read_text())
    tok = Tokenizer.load(folder / "tokenizer.model")
    ids = prompts(lambda s: tok.encode(s, bos=True), prompt_tokens, cfg["model"]["context_length"], gen_tokens, 1)[0]
    s = genai_generate_speed(folder, ids, gen_tokens, threads, repeats=BENCH_REPETITIONS)
    return {"load_s": s.load_s, "ttft_s": s.ttft_s, "gen_tps": s.tokens_per_s, "n_gen": s.new_tokens,
            "statistic": "best", "peak_rss_bytes": peak_rss_bytes()}


def llama_bench_args(path: Path, threads: int) -> list[str]:
    """llama-bench with the settings our llama.cpp row runs `path` with (threads, F16 KV cache, no
    flash attention, batch), so the two time the same llama.cpp work."""
    return ["-m", str(path), "-t", str(threads), "-fa", "off", "-b", str(N_BATCH), "-ub", str(N_BATCH),
            "-ctk", "f16", "-ctv", "f16", "-r", str(BENCH_REPETITIONS), "-o", "json"]


def measure_llama_bench(path: Path, threads: int, prompt_tokens: int, gen_tokens: int) -> dict:
    """llama.cpp's own llama-bench (no Python): prompt processing (pp) and generation (tg) tokens/s;
    tg at depth --prompt-tokens, where our path generates too."""
    from export.gguf.llama_tools import tool_path

    commands = []

    def bench(*args: str) -> tuple[dict, float]:
        """llama-bench's JSON record and the CPU seconds its process used."""
        cmd = [str(tool_path("llama-bench")), *llama_bench_args(path, threads), *args]
        commands.append(" ".join(cmd))
        cpu0 = _children_cpu_s()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError((p.stderr.strip().splitlines() or ["llama-bench failed"])[-1])
        return json.loads(p.stdout)[0], _children_cpu_s() - cpu0

    pp = bench("-p", str(prompt_tokens), "-n", "0")[0]["avg_ts"]
    depth = ("-p", "0", "-d", str(prompt_tokens))
    tg, tg_cpu = bench(*depth, "-n", str(gen_tokens))
    r = {"load_s": None, "ttft_s": prompt_tokens / pp, "gen_tps": tg["avg_ts"], "gen_tps_runs": tg["samples_ts"],
         "pp_tps": pp, "n_gen": gen_tokens, "commands": commands}
    if threads == 1:  # CPU per generated token: the same run with 1 token, subtracted (load, depth, warm-up)
        _, one_cpu = bench(*depth, "-n", "1")
        r["gen_cpu_s_per_token"] = (tg_cpu - one_cpu) / (BENCH_REPETITIONS * (gen_tokens - 1))
    r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * KIB  # the largest llama-bench
    return r


MEDIAN_KEYS = ("load_s", "ttft_s", "gen_tps", "gen_cpu_s_per_token", "pp_tps", "peak_rss_bytes", "load1")


def median_result(results: list[dict]) -> dict:
    """One row's result from its rounds: the first successful round's record, with the median of each
    timing over all successful rounds (every round's gen tok/s kept under gen_tps_rounds)."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    out = dict(ok[0])
    for key in MEDIAN_KEYS:
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    out["gen_tps_rounds"] = [r.get("gen_tps") for r in ok]
    return out


def _children_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve, so a
    child of a big parent would report the parent's peak."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def run_child(fmt_: dict, threads: int, args: argparse.Namespace, reference: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO), "BENCH_REFERENCE": str(reference)}
    cmd = [sys.executable, __file__, "--one", fmt_["runner"], str(fmt_["path"]), "--threads", str(threads),
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    if fmt_["runner"] != "torch":
        cmd += ["--reference", str(reference)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    load1 = os.getloadavg()[0]
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1], "load1": load1}
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "load1": load1}


def run_one(args: argparse.Namespace) -> dict:
    """Child mode (--one RUNNER PATH): one file measured in this process."""
    if args.one == "genai":
        return measure_genai(args.run, args.threads, args.prompt_tokens, args.gen_tokens)
    if args.one == "llama-bench":
        return measure_llama_bench(args.run, args.threads, args.prompt_tokens, args.gen_tokens)
    if args.one in RUNNERS:  # PATH: RUN/export/web/PAGE
        text = prompt_text(args.run.parents[2], args.prompt_tokens, PROMPT_TEXT)
        return measure_browser(args.run, args.threads, text, args.gen_tokens, BENCH_REPETITIONS)
    return measure_backend(args.one, args.run, args.threads, args.prompt_tokens, args.gen_tokens, args.reference)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder with checkpoints/ and export/")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the 'all threads' column")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--only", action="append", default=[], metavar="TEXT", help="rows whose label contains TEXT")
    ap.add_argument("--rounds", type=int, default=1, help="measure every row this many times, interleaved "
                    "(row after row, round after round), and report medians: a noisy machine drifts between rows")
    ap.add_argument("--out", type=Path, help=f"folder for {OUT_JSON} and {OUT_MD} (default: RUN_DIR)")
    ap.add_argument("--one", metavar="RUNNER", help=argparse.SUPPRESS)  # child mode: measure one file
    ap.add_argument("--reference", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return 0
    if not args.run.is_dir():
        print(f"error: not a run folder: {args.run}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"error: --rounds {args.rounds}: must be at least 1", file=sys.stderr)
        return 2
    out_dir = args.out or args.run
    if not out_dir.is_dir():
        print(f"error: --out {out_dir}: not a folder", file=sys.stderr)
        return 2
    found = formats(args.run)
    if args.only:
        found = [f for f in found if f["label"] == "PyTorch fp32" or any(o in f["label"] for o in args.only)]
    if not found or found[0]["runner"] != "torch":
        print(f"error: {args.run} holds no checkpoint (the fp32 reference)", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as td:
        reference = Path(td) / "reference.npy"
        runs: dict[tuple[int, int], list[dict]] = {}
        for k in range(args.rounds):
            for i, f in enumerate(found):
                for n in sorted({1, args.threads}):
                    print(f"round {k + 1}/{args.rounds}: measuring {f['label']} ({RUNTIME_NAMES[f['runner']]}, "
                          f"{f['path']}), {n} thread(s) ...", file=sys.stderr, flush=True)
                    runs.setdefault((i, n), []).append(run_child(f, n, args, reference))
        for i, f in enumerate(found):
            f["gen_tokens"] = args.gen_tokens
            f["results"] = {n: median_result(runs[(i, n)]) for n in sorted({1, args.threads})}
    head = (f"Serving benchmark: {args.run}, prompt {args.prompt_tokens} tokens, {args.gen_tokens} new tokens, greedy; "
            f"{os.cpu_count()} CPUs, load average {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. "
            f"Ours and llama-bench: mean of {BENCH_REPETITIONS} runs; ONNX Runtime GenAI: best of {BENCH_REPETITIONS}"
            + (f"; each row measured {args.rounds} times, interleaved, median shown." if args.rounds > 1 else "."))
    text = "\n\n".join([head, table(found, args.threads, RUNTIME_NAMES), *verdicts(found, args.threads)])
    print(text)
    record = {"run": str(args.run), "threads": args.threads, "prompt_tokens": args.prompt_tokens,
              "gen_tokens": args.gen_tokens, "cpus": os.cpu_count(), "load_start": load_start,
              "load_end": os.getloadavg()[0], "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "rows": [{**{k: v for k, v in f.items() if k != "results"}, "path": str(f["path"]),
                        "results": {str(n): r for n, r in f["results"].items()}} for f in found]}
    (out_dir / OUT_JSON).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / OUT_MD).write_text(text + "\n", encoding="utf-8")
    print(f"\nwrote {out_dir / OUT_JSON} and {out_dir / OUT_MD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

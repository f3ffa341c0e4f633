"""One serving table: every format of one model, through our Python backends, llama.cpp's own
tools and ONNX Runtime GenAI, as Markdown.

    python tests/benchmarks/bench_serving.py RUN_DIR [--threads N] [--prompt-tokens 128] [--gen-tokens 64]

Rows, whichever exist:
- our Python path (serving.Backend): PyTorch fp32 (the run's latest checkpoint), ONNX fp32/int8/int4
  (RUN_DIR/export/onnx/), GGUF F16/Q8_0/Q4_K_M through llama-cpp-python (RUN_DIR/export/gguf/);
- llama.cpp's `llama-bench` on the same GGUF files (when scripts/build_llama_tools.sh built it);
- ONNX Runtime GenAI on RUN_DIR/export/onnx/genai/<variant>/ (export/genai.py; when
  `onnxruntime-genai` is installed).
Columns: file size, load time, time to first token (prompt of --prompt-tokens), generation tokens/s
at 1 thread and at --threads (default: all cores), peak RSS, and KL / top-1 agreement vs the PyTorch
fp32 model on one held-out Bangla window (tool rows run the same file as the Python row above them,
so their quality is that file's). Every measurement runs in its own process (clean peak RSS, no
shared thread pools). Greedy decoding, so every runtime does the same work per token.

Targets: llama.cpp Q4_K_M generates >= 5x as fast as PyTorch fp32; our Python llama.cpp path
generates >= 0.9x raw llama-bench speed on the same file and threads.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPT_TEXT = ("আমাদের গ্রামের পাশ দিয়ে একটি ছোট নদী বয়ে গেছে। বর্ষায় নদী ভরে ওঠে, শীতে শান্ত হয়ে যায়। "
               "সকালবেলা কৃষকেরা মাঠে যায়, ছেলেমেয়েরা স্কুলে যায়, আর মায়েরা রান্নাঘরে ব্যস্ত থাকেন। ")
HELDOUT = REPO / "training" / "assets" / "eval" / "heldout_bn.txt"
ONNX_VARIANTS = {"model.onnx": ("ONNX fp32", "fp32"), "model-int8.onnx": ("ONNX int8", "int8"),
                 "model-int4.onnx": ("ONNX int4", "int4")}
GGUF_TYPES = ("F16", "Q8_0", "Q4_K_M")
TARGET_SPEEDUP = 5.0
TARGET_VS_LLAMA_BENCH = 0.9
BENCH_REPETITIONS = 3
KIB = 1024


# ------------------------------------------------------------------------------------ what exists
def formats(run: Path) -> list[dict]:
    """Every (label, runner, path, bytes, quality source) present in the run."""
    from export.genai import GENAI_CONFIG, GENAI_DIR
    from export.llama_tools import find_tool
    from training import layout
    from training.checkpoint import latest

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
            size = f.stat().st_size + sum(p.stat().st_size for p in onnx.glob(f"{name}.data*"))
            out.append({"label": label, "runner": "onnx", "path": f, "bytes": size})
            g = onnx / GENAI_DIR / variant
            if genai and (g / GENAI_CONFIG).is_file():
                out.append({"label": f"{label}, ONNX Runtime GenAI", "runner": "genai", "path": g, "bytes": size,
                            "same_as": label})
    bench = find_tool("llama-bench")
    for t in GGUF_TYPES:
        for f in sorted((run / layout.EXPORT / layout.GGUF_DIR).glob(f"*-{t}.gguf")):
            out.append({"label": f"GGUF {t}", "runner": "llama.cpp", "path": f, "bytes": f.stat().st_size})
            if bench is not None:
                out.append({"label": f"GGUF {t}, llama-bench", "runner": "llama-bench", "path": f,
                            "bytes": f.stat().st_size, "same_as": f"GGUF {t}"})
    return out


def _has_genai() -> bool:
    from importlib.util import find_spec

    return find_spec("onnxruntime_genai") is not None


# ------------------------------------------------------------------------------------ measuring
def prompt_ids(tokenize, prompt_tokens: int, n_ctx: int, gen_tokens: int) -> list[int]:
    text = PROMPT_TEXT
    while len(tokenize(text)) < prompt_tokens:
        text += PROMPT_TEXT
    return tokenize(text)[:min(prompt_tokens, n_ctx - gen_tokens - 1)]


def quality_window(tokenize, n_ctx: int) -> list[int]:
    return tokenize(HELDOUT.read_text(encoding="utf-8"))[:n_ctx]


def measure_backend(kind: str, path: Path, threads: int, prompt_tokens: int, gen_tokens: int,
                    reference: Path | None) -> dict:
    """Our Python path (runs in the child process)."""
    import numpy as np

    from serving import load
    from serving.backend import SamplingParams
    from training.logprobs import kl_rows

    t0 = time.perf_counter()
    b = load(path, backend=kind, threads=threads)
    load_s = time.perf_counter() - t0
    ids = prompt_ids(b.tokenize, prompt_tokens, b.n_ctx, gen_tokens)
    list(b.generate(ids[:8], SamplingParams.greedy(2)))  # warm-up
    start = time.perf_counter()
    first, n = None, 0
    for _ in b.generate(ids, SamplingParams.greedy(gen_tokens)):
        n += 1
        if first is None:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    r = {"load_s": load_s, "ttft_s": first, "n_gen": n,
         "gen_tps": (n - 1) / (total - first) if n > 1 and first is not None else None}
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
    """ONNX Runtime GenAI (child process): our tokenizer's ids, greedy search."""
    import onnxruntime_genai as og

    from training.tokenizer import Tokenizer

    cfg = json.loads((folder / "genai_config.json").read_text())
    t0 = time.perf_counter()
    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                                        "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - t0
    tok = Tokenizer.load(folder / "tokenizer.model")
    ids = prompt_ids(lambda s: tok.encode(s, bos=True), prompt_tokens, cfg["model"]["context_length"], gen_tokens)

    def run(n_new: int) -> tuple[float | None, int, float]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n_new, min_length=len(ids) + n_new, do_sample=False)
        gen = og.Generator(model, params)
        start = time.perf_counter()
        gen.append_tokens(ids)
        first, n = None, 0
        while not gen.is_done():
            gen.generate_next_token()
            n += 1
            if first is None:
                first = time.perf_counter() - start
        return first, n, time.perf_counter() - start

    run(2)  # warm-up
    first, n, total = run(gen_tokens)
    return {"load_s": load_s, "ttft_s": first, "n_gen": n,
            "gen_tps": (n - 1) / (total - first) if n > 1 and first is not None else None,
            "peak_rss_bytes": peak_rss_bytes()}


def measure_llama_bench(path: Path, threads: int, prompt_tokens: int, gen_tokens: int) -> dict:
    """llama.cpp's own llama-bench (no Python): prompt processing and generation tokens/s."""
    from export.llama_tools import tool_path

    def bench(*args: str) -> list[dict]:
        p = subprocess.run([str(tool_path("llama-bench")), "-m", str(path), "-t", str(threads), "-o", "json",
                            "-r", str(BENCH_REPETITIONS), *args], capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError((p.stderr.strip().splitlines() or ["llama-bench failed"])[-1])
        return json.loads(p.stdout)

    pp = bench("-p", str(prompt_tokens), "-n", "0")[0]["avg_ts"]
    tg = bench("-p", "0", "-n", str(gen_tokens))[0]["avg_ts"]
    return {"load_s": None, "ttft_s": prompt_tokens / pp, "gen_tps": tg, "pp_tps": pp, "peak_rss_bytes": None}


def peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve, so a
    child of a big parent would report the parent's peak."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB


def run_child(fmt_: dict, threads: int, args: argparse.Namespace, reference: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO), "BENCH_REFERENCE": str(reference)}
    cmd = [sys.executable, __file__, "--one", fmt_["runner"], str(fmt_["path"]), "--threads", str(threads),
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    if fmt_["runner"] != "torch":
        cmd += ["--reference", str(reference)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ the table
def fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def table(rows: list[dict], threads: int) -> str:
    lines = [f"| format | runtime | file MiB | load s | TTFT ms | gen tok/s, 1 thread | gen tok/s, {threads} threads "
             "| peak RSS MiB | KL vs fp32 | top-1 vs fp32 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_label = {r["label"]: r for r in rows}
    for r in rows:
        one, many = r["results"].get(1, {}), r["results"].get(threads, {})
        err = one.get("error") or many.get("error")
        label, _, runtime = r["label"].partition(", ")
        runtime = runtime or {"torch": "PyTorch", "onnx": "ONNX Runtime (prodip)",
                              "llama.cpp": "llama-cpp-python (prodip)"}[r["runner"]]
        if err:
            lines.append(f"| {label} | {runtime} | {r['bytes'] / KIB**2:.1f} | error: {err} | | | | | | |")
            continue
        q = by_label[r["same_as"]]["results"].get(threads, {}) if r.get("same_as") else many
        rss = many.get("peak_rss_bytes")
        lines.append(f"| {label} | {runtime} | {r['bytes'] / KIB**2:.1f} | {fmt(many.get('load_s'), '.2f')} | "
                     f"{fmt(many.get('ttft_s') and many['ttft_s'] * 1000, '.0f')} | {fmt(one.get('gen_tps'), '.1f')} | "
                     f"{fmt(many.get('gen_tps'), '.1f')} | {fmt(rss and rss / KIB**2, '.0f')} | "
                     f"{fmt(q.get('kl'), '.2e') if r['runner'] != 'torch' else '0'} | "
                     f"{fmt(q.get('top1') and q['top1'] * 100, '.1f') + '%' if q.get('top1') is not None else '—'} |")
    return "\n".join(lines)


def verdicts(rows: list[dict], threads: int) -> list[str]:
    out = []
    speed = {r["label"]: r["results"].get(threads, {}).get("gen_tps") for r in rows}
    if speed.get("GGUF Q4_K_M") and speed.get("PyTorch fp32"):
        x = speed["GGUF Q4_K_M"] / speed["PyTorch fp32"]
        out.append(f"llama.cpp Q4_K_M generates {x:.1f}x as fast as PyTorch fp32 "
                   f"({'meets' if x >= TARGET_SPEEDUP else 'misses'} the >= {TARGET_SPEEDUP:.0f}x target).")
    for t in GGUF_TYPES:
        for n in sorted({1, threads}):
            ours = next((r["results"].get(n, {}).get("gen_tps") for r in rows if r["label"] == f"GGUF {t}"), None)
            raw = next((r["results"].get(n, {}).get("gen_tps") for r in rows if r["label"] == f"GGUF {t}, llama-bench"), None)
            if ours and raw:
                x = ours / raw
                out.append(f"GGUF {t}, {n} thread(s): our Python path {ours:.1f} tok/s = {x:.2f}x llama-bench {raw:.1f} "
                           f"({'meets' if x >= TARGET_VS_LLAMA_BENCH else 'misses'} >= {TARGET_VS_LLAMA_BENCH}x).")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder with checkpoints/ and export/")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the 'all threads' column")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--only", action="append", default=[], metavar="TEXT", help="rows whose label contains TEXT")
    ap.add_argument("--one", metavar="RUNNER", help=argparse.SUPPRESS)  # child mode: measure one file
    ap.add_argument("--reference", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        if args.one == "genai":
            r = measure_genai(args.run, args.threads, args.prompt_tokens, args.gen_tokens)
        elif args.one == "llama-bench":
            r = measure_llama_bench(args.run, args.threads, args.prompt_tokens, args.gen_tokens)
        else:
            r = measure_backend(args.one, args.run, args.threads, args.prompt_tokens, args.gen_tokens, args.reference)
        print(json.dumps(r))
        return 0
    if not args.run.is_dir():
        print(f"error: not a run folder: {args.run}", file=sys.stderr)
        return 2
    found = formats(args.run)
    if args.only:
        found = [f for f in found if f["label"] == "PyTorch fp32" or any(o in f["label"] for o in args.only)]
    if not found or found[0]["runner"] != "torch":
        print(f"error: {args.run} holds no checkpoint (the fp32 reference)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as td:
        reference = Path(td) / "reference.npy"
        for f in found:
            f["results"] = {}
            for n in sorted({1, args.threads}):
                print(f"measuring {f['label']} ({f['path']}), {n} thread(s) ...", file=sys.stderr, flush=True)
                f["results"][n] = run_child(f, n, args, reference)
    print(f"Serving benchmark: {args.run}, prompt {args.prompt_tokens} tokens, {args.gen_tokens} new tokens, greedy; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end\n")
    print(table(found, args.threads))
    for line in verdicts(found, args.threads):
        print(f"\n{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

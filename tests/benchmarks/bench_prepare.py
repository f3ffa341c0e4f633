"""Benchmark: training.prepare throughput per pass and per worker, scaling, peak RSS, and the
projection for 2 B tokens on a 16-core machine.

    .venv/bin/python tests/benchmarks/bench_prepare.py [--sizes-mb 250,1500] [--stage-mb 20] [--workers 1,2] [--memory-gb 2]

1. Generates synthetic corpora (JSONL, Bangla-first) from the corpus shipped in training/assets with
   a word-bigram random walk per file (new text, not copied), with planted exact copies (4 %) and
   one-word-changed near copies (2 %) so deduplication has work to do.
2. Per-pass rates, one process (`--stage-mb` of the corpus): read (main), clean/judge (worker:
   normalize, quality rules, decontamination n-grams, MinHash), dedup index (main), encode (worker:
   normalize + SentencePiece), shard writing (main), in MB of input per CPU-second.
3. The whole pipeline (`prepare(..., tokenizer=..., memory_gb=...)`) on the first size with each
   worker count (scaling), on the other sizes with the most workers, in a subprocess: wall time, CPU
   time, peak RSS of the main process (VmHWM) and of the largest worker, and the peaks of the summed
   RSS and PSS of the whole process tree (sampled every 0.25 s from /proc), the dedup index size.
4. Memory flatness: the peaks of the smallest and the largest corpus, in % growth.
5. The projection: 2 B tokens at the measured bytes/token; worker passes divide by the workers the
   memory budget fits on 16 cores, the main process's serial work does not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from training.prepare.clean import _dedup, init_worker, judge_chunk, raw_texts  # noqa: E402
from training.prepare.cluster.pool import chunks  # noqa: E402
from training.prepare.cluster.worker_memory import DEFAULT_MEMORY_GB, plan_memory  # noqa: E402
from training.prepare.decontam import EvalIndex, resolve_eval_paths  # noqa: E402
from training.prepare.dedup import DedupIndex  # noqa: E402
from training.prepare.encode import encode_chunk  # noqa: E402
from training.prepare.encode import init_worker as init_encoder  # noqa: E402
from training.prepare.errors import PrepareError  # noqa: E402
from training.prepare.options import DEFAULT_SHARD_TOKENS  # noqa: E402
from training.prepare.quality import load_config  # noqa: E402
from training.prepare.sources import FileSource, iter_file_docs, resolve_inputs  # noqa: E402

ASSETS = REPO / "training" / "assets" / "corpus"
TARGET_TOKENS = 2_000_000_000
TARGET_CORES = 16
EXACT_COPY, NEAR_COPY = 0.04, 0.02
JUMP = 0.2


# ---------------------------------------------------------------- synthetic corpus


def bigram_models() -> list[tuple[dict[str, list[str]], list[str], float]]:
    """Per shipped file: successor lists, sentence starts and its share of the corpus bytes."""
    files = resolve_inputs([ASSETS])
    total = sum(f.stat().st_size for f in files)
    models = []
    for f in files:
        succ: dict[str, list[str]] = defaultdict(list)
        starts: list[str] = []
        for doc in iter_file_docs(f):
            words = doc.split()
            if words:
                starts.append(words[0])
            for a, b in zip(words, words[1:]):
                succ[a].append(b)
        models.append((dict(succ), starts, f.stat().st_size / total))
    return models


def generate(folder: Path, size_mb: int, seed: int = 0) -> Path:
    """JSONL files of ~64 MB with `size_mb` MB of generated documents (cached by size and seed)."""
    folder = folder / f"synthetic_v2_{size_mb}mb_s{seed}"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    models = bigram_models()
    weights = [m[2] for m in models]
    written, part, out, recent = 0, 0, None, []
    target = size_mb * 1_000_000
    while written < target:
        if out is None or out.tell() > 64_000_000:
            if out:
                out.close()
            out = open(folder / f"part_{part:05d}.jsonl", "w", encoding="utf-8")  # noqa: SIM115
            part += 1
        r = rng.random()
        if recent and r < EXACT_COPY:
            doc = rng.choice(recent)
        elif recent and r < EXACT_COPY + NEAR_COPY:
            words = rng.choice(recent).split(" ")
            words[len(words) // 2] = "বদল"
            doc = " ".join(words)
        else:
            succ, starts, _ = rng.choices(models, weights)[0]
            vocab = list(succ)
            w = rng.choice(starts)
            words = [w]
            for _ in range(rng.randint(60, 400)):
                nxt = succ.get(w)
                # A jump now and then: a small corpus has long forced chains that would repeat.
                w = rng.choice(nxt) if nxt and rng.random() > JUMP else rng.choice(vocab)
                words.append(w)
            doc = " ".join(words)
            recent.append(doc)
            if len(recent) > 2000:
                recent.pop(rng.randrange(len(recent)))
        line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
        out.write(line)
        written += len(line.encode("utf-8"))
    out.close()
    done.touch()
    return folder


# ---------------------------------------------------------------- per-pass rates, one process


def stage_rates(corpus: Path, tokenizer: Path, limit_mb: float) -> dict[str, float]:
    """MB of input per CPU-second for each pass, measured in this process on the first `limit_mb` MB."""
    from training.data.loaders import ShardWriter
    from training.text.tokenizer import Tokenizer

    sources = [FileSource(f) for f in resolve_inputs([corpus])]
    texts, size = [], 0
    t = time.process_time()
    for x in raw_texts(sources, "text"):
        texts.append(x)
        size += len(x.encode("utf-8"))
        if size >= limit_mb * 1e6:
            break
    rates = {"read (main)": size / 1e6 / (time.process_time() - t)}
    cfg = load_config()
    eval_index = EvalIndex.build(resolve_eval_paths([]), cfg.decontam["ngram_words"], cfg.decontam["min_words"])
    init_worker(cfg.quality, eval_index, {**cfg.dedup, "near": True},
                {"seed": 0, "val_fraction": 0.05, "num_shards": 1, "shard_index": 0})
    cks = list(chunks(texts))
    t = time.process_time()
    verdicts = [judge_chunk(c)[0] for c in cks]
    rates["clean: normalize + rules + decontam + MinHash (worker)"] = size / 1e6 / (time.process_time() - t)
    index = DedupIndex(cfg.dedup["max_index_mb"])
    t = time.process_time()
    dups = [_dedup(v, index) for v in verdicts]
    rates["dedup index (main)"] = size / 1e6 / (time.process_time() - t)
    kept = [x for c, v, d in zip(cks, verdicts, dups) for x, vv, dd in zip(c, v, d) if vv[0] == "ok" and dd is None]
    kept_mb = sum(len(x.encode("utf-8")) for x in kept) / 1e6
    tok = Tokenizer.load(tokenizer)
    init_encoder(tok.proto)
    t = time.process_time()
    encoded = [encode_chunk(c, None, 0.05, 0, "uint16") for c in chunks(kept)]
    rates["encode: normalize + SentencePiece (worker)"] = kept_mb / (time.process_time() - t)
    with tempfile.TemporaryDirectory() as tmp:
        w = ShardWriter(Path(tmp), tok.vocab_size, tok.sha256)
        t = time.process_time()
        for e in encoded:
            w.add(e["splits"]["train"]["tokens"])
        w.close()
        rates["write shards (main)"] = kept_mb / max(time.process_time() - t, 1e-6)
    rates["_kept_share"] = kept_mb * 1e6 / size
    n_tok = sum(int(e["splits"][s]["tokens"].size) for e in encoded for s in ("train", "val"))
    rates["_bytes_per_token"] = kept_mb * 1e6 / n_tok
    return rates


# ---------------------------------------------------------------- whole pipeline, subprocess

RUNNER = """
import json, os, sys, time
from training.prepare import prepare

def hwm_kb():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1])

t0, c0 = time.perf_counter(), os.times()
meta = prepare([sys.argv[1]], sys.argv[2], tokenizer=sys.argv[3], workers=int(sys.argv[4]), progress=False,
               force=True, fertility_floor=1.0, skip_gates=['tokenizer.balance'], memory_gb=float(sys.argv[5]))
wall, c = time.perf_counter() - t0, os.times()
rep = json.load(open(sys.argv[2] + '/report.json'))
print(json.dumps({'wall': wall, 'cpu': sum(c[:4]) - sum(c0[:4]), 'main_cpu': c[0] + c[1] - c0[0] - c0[1],
                  'rss_main_mb': hwm_kb() / 1024, 'tokens': sum(s['n_tokens'] for s in meta['splits'].values()),
                  'memory': rep['memory'], 'dedup': rep['dedup'], 'dropped': rep['documents']['dropped_by_reason']}))
"""
SAMPLE_S = 0.5


def _proc_kb(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """pid and its descendants (the pool's workers), from /proc/PID/task/PID/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def sample_tree(proc: subprocess.Popen, peak: dict) -> None:
    """Until `proc` ends, every SAMPLE_S: the largest worker VmHWM and the peaks of the summed RSS and
    PSS (shared pages split between the processes sharing them) over its whole process tree. It runs
    in the benchmark's process, so its own CPU time is not counted as the pipeline's."""
    while proc.poll() is None:
        procs = _tree(proc.pid)
        kids = procs[1:]
        peak["worker"] = max([peak["worker"]] + [_proc_kb(f"/proc/{k}/status", "VmHWM") for k in kids])
        peak["rss_all"] = max(peak["rss_all"], sum(_proc_kb(f"/proc/{k}/status", "VmRSS") for k in procs))
        peak["pss_all"] = max(peak["pss_all"], sum(_proc_kb(f"/proc/{k}/smaps_rollup", "Pss:") for k in procs))
        peak["procs"] = max(peak["procs"], len(procs))
        time.sleep(SAMPLE_S)


def whole(corpus: Path, tokenizer: Path, workers: int, out: Path, memory_gb: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(corpus), str(out), str(tokenizer), str(workers),
                             str(memory_gb)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=env)
    peak = {"worker": 0, "rss_all": 0, "pss_all": 0, "procs": 0}
    sampler = threading.Thread(target=sample_tree, args=(proc, peak), daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"prepare failed:\n{stderr[-3000:]}")
    r = json.loads(stdout.strip().splitlines()[-1])
    return {**r, "rss_worker_mb": peak["worker"] / 1024, "rss_all_mb": peak["rss_all"] / 1024,
            "pss_all_mb": peak["pss_all"] / 1024, "procs": peak["procs"]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", default="250,1500", help="corpus sizes (MB), comma-separated")
    ap.add_argument("--stage-mb", type=float, default=20, help="MB of the first corpus for the per-pass rates")
    ap.add_argument("--workers", default=f"1,{os.cpu_count()}", help="worker counts for the first size (scaling)")
    ap.add_argument("--memory-gb", type=float, default=DEFAULT_MEMORY_GB, help="prepare's memory budget")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "prodip_bench_prepare",
                    help="where the generated corpora and outputs go (outside the repository)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    workers = sorted({int(w) for w in args.workers.split(",")})
    args.work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    corpora = {s: generate(args.work, s) for s in sizes}
    print(f"generated {', '.join(f'{s} MB' for s in sizes)} in {time.perf_counter() - t:.0f} s", flush=True)

    tok_dir = args.work / "tokenizer_data"
    if not (tok_dir / "tokenizer.model").exists():  # a 8k tokenizer trained once on the shipped corpus' twin
        from training.prepare import prepare

        prepare([generate(args.work, 20)], tok_dir, vocab_size=8192, progress=False, force=True,
                fertility_floor=1.0, skip_gates=["tokenizer.balance"])
    tokenizer = tok_dir / "tokenizer.model"

    rates = stage_rates(corpora[sizes[0]], tokenizer, args.stage_mb)
    print(f"\n## Per-pass rates, one process, first {args.stage_mb:g} MB of the {sizes[0]} MB corpus\n")
    print("| pass | MB of input per CPU-second |\n|---|---:|")
    for k, v in rates.items():
        if not k.startswith("_"):
            print(f"| {k} | {v:.2f} |")
    print(f"\nkept after cleaning: {rates['_kept_share']:.1%} of bytes; {rates['_bytes_per_token']:.2f} bytes/token",
          flush=True)

    print(f"\n## Whole pipeline (clean + encode + write, --tokenizer given, --memory-gb {args.memory_gb:g})\n")
    print("| corpus | workers | wall s | CPU s (main) | MB per CPU-s | peak RSS main | peak RSS one worker | "
          "peak RSS all processes | peak PSS all processes | dedup index (docs indexed / capacity) | tokens |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = {}
    for s in sizes:
        for w in (workers if s == sizes[0] else workers[-1:]):  # scaling on the first size only
            r = whole(corpora[s], tokenizer, w, args.work / f"out_{s}_{w}", args.memory_gb)
            results[(s, w)] = r
            d = r["dedup"]
            print(f"| {s} MB | {r['memory']['workers']} | {r['wall']:.0f} | {r['cpu']:.0f} ({r['main_cpu']:.0f}) | "
                  f"{s / r['cpu']:.2f} | {r['rss_main_mb']:.0f} MiB | {r['rss_worker_mb']:.0f} MiB | "
                  f"{r['rss_all_mb']:.0f} MiB | {r['pss_all_mb']:.0f} MiB | {d['index_bytes'] / 2**20:.0f} MiB "
                  f"({d['indexed_docs']:,} / {d['index_capacity_docs']:,}) | {r['tokens']:,} |", flush=True)
    flatness(results, sizes, workers[-1])
    project(rates, results, sizes, args.memory_gb)


def flatness(results: dict, sizes: list[int], w: int) -> None:
    """Peak memory of the smallest and the largest corpus, same worker count: the growth in %."""
    a, b = results[(sizes[0], w)], results[(sizes[-1], w)]
    print(f"\n## Memory from {sizes[0]} MB to {sizes[-1]} MB ({sizes[-1] / sizes[0]:.0f}x the corpus), {w} workers\n")
    for key, name in (("rss_main_mb", "peak RSS main process"), ("rss_all_mb", "peak RSS sum, all processes"),
                      ("pss_all_mb", "peak PSS sum, all processes")):
        print(f"{name}: {a[key]:.0f} -> {b[key]:.0f} MiB ({(b[key] / a[key] - 1):+.1%})")
    print(f"budget: {a['memory']['budget_mb']} MiB (index {a['memory']['index_mb']} MiB, "
          f"{a['memory']['workers']} workers)", flush=True)


def project(rates: dict, results: dict, sizes: list[int], memory_gb: float) -> None:
    """2 B tokens on 16 cores, from CPU seconds (the load-independent figures) of the largest
    multi-worker run: the main process's CPU is serial, the workers' CPU divides by the workers the
    memory budget allows on 16 cores (at most 15: one core is the main process's). A budget whose dedup
    index holds fewer documents than 2 B tokens have would dedup only part of them, so the projection
    is also given at the smallest budget (quarter GB steps) whose index holds them all."""
    s, w = max(results, key=lambda k: (k[0], k[1]))
    r = results[(s, w)]
    bpt, kept = rates["_bytes_per_token"], rates["_kept_share"]
    raw_mb = TARGET_TOKENS * bpt / kept / 1e6
    docs = raw_mb * r["dedup"]["indexed_docs"] / s  # kept documents per MB read, from the same run
    main_per_mb, worker_per_mb = r["main_cpu"] / s, (r["cpu"] - r["main_cpu"]) / s
    print(f"\n## Projection: 2 B tokens on {TARGET_CORES} cores\n")
    print(f"{bpt:.2f} bytes/token (this tokenizer, this text), {kept:.0%} of the bytes kept -> "
          f"{raw_mb / 1e3:.1f} GB read, ~{docs / 1e6:.1f} M kept documents. From the {s} MB run with {w} "
          f"workers: main process {1 / main_per_mb:.2f} MB per CPU-s (serial: reading, dedup index, shard "
          f"writes, IPC), workers {1 / worker_per_mb:.2f} MB per CPU-s.\n")
    print("| --memory-gb | workers | index MiB | documents indexed | main process min | workers min | wall min | 1 h |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for gb in dict.fromkeys([memory_gb, budget_indexing_all(docs)]):
        if gb is None:
            print(f"| – | | | no budget indexes {docs:,.0f} documents under max_index_mb: use --num-shards | | | | |")
            continue
        plan = plan_memory(gb, TARGET_CORES - 1, DEFAULT_SHARD_TOKENS, load_config().dedup["max_index_mb"])
        cap = DedupIndex(plan.index_mb).capacity_docs
        main_s, worker_s = raw_mb * main_per_mb, raw_mb * worker_per_mb / plan.workers
        wall = max(main_s, worker_s)
        share = "all" if cap >= docs else f"first {cap:,} ({cap / docs:.0%}): incomplete"
        print(f"| {gb:g} | {plan.workers} | {plan.index_mb} | {share} | {main_s / 60:.0f} | {worker_s / 60:.0f} | "
              f"{wall / 60:.0f} | {'met' if wall <= 3600 else 'missed'} |")
    print("\n(tokenizer training, a fixed cost, not included; "
          f"this machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})")


def budget_indexing_all(docs: float, step_gb: float = 0.25, max_gb: float = 64.0) -> float | None:
    """The smallest --memory-gb giving 15 workers and an index that holds `docs` documents."""
    max_index = load_config().dedup["max_index_mb"]
    for i in range(1, int(max_gb / step_gb) + 1):
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # "fits N workers" warnings of the smaller budgets
                plan = plan_memory(i * step_gb, TARGET_CORES - 1, DEFAULT_SHARD_TOKENS, max_index)
        except PrepareError:  # too small for one worker
            continue
        if plan.workers == TARGET_CORES - 1 and DedupIndex(plan.index_mb).capacity_docs >= docs:
            return i * step_gb
        if plan.workers == TARGET_CORES - 1 and plan.index_mb >= max_index:
            return None  # the index is at its cap and still too small
    return None


if __name__ == "__main__":
    main()

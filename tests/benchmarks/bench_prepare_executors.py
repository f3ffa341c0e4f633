"""Benchmark: `--executor local --tasks N` against one process on the same corpus (the same bytes
out; wall and CPU seconds), the per-task throughput of each stage, and a projection for 100 B tokens
on a cluster.

    .venv/bin/python tests/benchmarks/bench_prepare_executors.py [--size-mb 24] [--files 8] [--tasks 2]

The corpus is bench_prepare.py's synthetic Bangla-first JSONL (4 % exact, 2 % near copies planted),
cut into --files contiguous files (tasks split a corpus by files). Each run is a subprocess whose
process tree (driver, datatrove's fork server and pool, prodip's workers) is sampled every 0.1 s
from /proc for CPU seconds. The stages' own wall/CPU seconds come from each task's task.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prepare import REPO, generate  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
TARGET_TOKENS = 100_000_000_000
FLAGS = ["--no-progress", "--fertility-floor", "1.0", "--skip-gate", "tokenizer.balance", "--memory-gb", "2"]


def split(corpus: Path, files: int, out: Path) -> Path:
    """The corpus's lines in `files` contiguous JSONL files of about equal size."""
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    lines = [line for p in sorted(corpus.glob("*.jsonl")) for line in p.read_text(encoding="utf-8").splitlines(True)]
    per = -(-len(lines) // files)
    for i in range(files):
        (out / f"part_{i:03d}.jsonl").write_text("".join(lines[i * per:(i + 1) * per]), encoding="utf-8")
    (out / ".complete").touch()
    return out


def _cpu_of_tree(pid: int, seen: dict[int, float]) -> None:
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            seen[p] = max(seen.get(p, 0.0), (int(f[11]) + int(f[12])) / TICKS)  # utime + stime
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, IndexError):
            pass


def run(argv: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "training.prepare", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen: dict[int, float] = {}

    def sample():
        while proc.poll() is None:
            _cpu_of_tree(proc.pid, seen)
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    th.join()
    if proc.returncode:
        raise SystemExit(f"failed: {argv}\n{err[-3000:]}")
    return {"wall": time.perf_counter() - t0, "cpu": sum(seen.values()), "procs": len(seen)}


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=24, help="synthetic corpus size")
    ap.add_argument("--files", type=int, default=8, help="files the corpus is cut into")
    ap.add_argument("--tasks", type=int, default=2, help="--tasks of the executor run")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "prodip_bench_executors")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = split(generate(args.work, args.size_mb), args.files, args.work / f"split_{args.size_mb}_{args.files}")
    tok = args.work / "tok"
    if not (tok / "tokenizer.model").exists():
        run(["--input", str(generate(args.work, 4)), "--out", str(tok), "--vocab-size", "8192", "--force", *FLAGS])
    base = ["--input", str(corpus), "--tokenizer", str(tok / "tokenizer.model"), "--workers", "1", "--force", *FLAGS]
    one = run([*base, "--out", str(args.work / "one")])
    ex_out = args.work / "ex"
    subprocess.run(["rm", "-rf", str(ex_out), str(ex_out) + ".work"], check=True)
    ex = run([*base, "--out", str(ex_out), "--executor", "local", "--tasks", str(args.tasks)])
    same = tree(args.work / "one") == tree(ex_out)
    meta = json.loads((ex_out / "meta.json").read_text())
    tokens = sum(s["n_tokens"] for s in meta["splits"].values())
    mb = sum(p.stat().st_size for p in corpus.glob("*.jsonl")) / 1e6
    print(f"corpus {mb:.1f} MB in {args.files} files, {tokens:,} tokens; output identical: {same}\n")
    print("| run | wall s | CPU s | processes |\n|---|---:|---:|---:|")
    for name, r in (("one process (--workers 1)", one), (f"--executor local --tasks {args.tasks}", ex)):
        print(f"| {name} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['procs']} |")
    print(f"\nratios executor/one process: wall {ex['wall'] / one['wall']:.2f}, CPU {ex['cpu'] / one['cpu']:.2f}")
    stages(ex_out.with_name(ex_out.name + ".work"), mb, tokens, args.tasks)


def stages(work: Path, mb: float, tokens: int, tasks: int) -> None:
    print("\n| stage | tasks | wall s per task (max) | CPU s (all tasks) | MB of input per CPU-s |\n|---|---:|---:|---:|---:|")
    rates = {}
    for stage in ("scan", "dedup", "encode"):
        heads = [json.loads(p.read_text()) for p in sorted((work / stage).glob("*/task.json"))]
        cpu = sum(h["seconds"]["cpu"] for h in heads)
        rates[stage] = mb / cpu
        print(f"| {stage} | {len(heads)} | {max(h['seconds']['wall'] for h in heads):.2f} | {cpu:.2f} | "
              f"{rates[stage]:.2f} |")
    project(rates, mb, tokens)


def project(rates: dict[str, float], mb: float, tokens: int, nodes: int = 64, cores: int = 32) -> None:
    """100 B tokens: scan and encode divide over nodes x cores; dedup (and the merge's copy) do not."""
    total_mb = TARGET_TOKENS * (mb / tokens)
    par = nodes * cores
    scan_h = total_mb / rates["scan"] / par / 3600
    encode_h = total_mb / rates["encode"] / par / 3600
    dedup_h = total_mb / rates["dedup"] / 3600
    print(f"\nprojection, 100 B tokens = {total_mb / 1e6:,.2f} TB of this input ({mb * 1e6 / tokens:.1f} bytes/token "
          f"read): {nodes} tasks x {cores} cores: scan {scan_h:.2f} h + dedup {dedup_h:.2f} h (one task) + "
          f"encode {encode_h:.2f} h = {scan_h + dedup_h + encode_h:.2f} h, before the merge's copy of the tokens")


if __name__ == "__main__":
    main()

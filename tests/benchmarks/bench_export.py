"""Benchmark: time and peak RSS to export the 400m preset (random init) to each format.

    .venv/bin/python tests/benchmarks/bench_export.py [--preset 400m] [--work DIR] [--skip-onnx]

Each export runs as its own `python -m export ... --no-parity` process, so its peak RSS (ru_maxrss of
that process, from os.wait4) is measured alone. Targets: GGUF Q4_K_M and streamed ONNX fp32
(export/onnx_stream.py) from a checkpoint in <= 60 s and peak RSS <= 2x the fp32 model size. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CORPUS = ROOT.parent / "shared" / "data" / "bn" / "train" / "majantali_bnarchive"
BUNDLED = ROOT / "training" / "assets" / "corpus"
TARGET_Q4_S = 60.0
TARGET_RSS_RATIO = 2.0
GiB = 1 << 30


def make_checkpoint(preset_name: str, work: Path) -> tuple[Path, int]:
    import torch

    from training.checkpoint import checkpoint_io as checkpoint
    from training.model.decoder import Transformer, count_params, preset

    done = checkpoint.latest(work / "run") if (work / "run").is_dir() else None
    if done is not None:  # a kept --work folder: reuse its checkpoint (same preset, random init)
        return done, count_params(checkpoint.load(done).config)
    from training.text.normalization import normalize
    from training.text.tokenizer import train_tokenizer

    files = sorted(CORPUS.glob("*.md")) if CORPUS.is_dir() else sorted(BUNDLED.glob("*.txt"))
    lines = [normalize(x) for f in files for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    want = preset(preset_name).vocab_size
    tok = train_tokenizer(lines, want, num_threads=os.cpu_count() or 1)
    cfg = preset(preset_name, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Transformer(cfg)
    ck = checkpoint.save(work / "run", 0, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg,
                         tokenizer=tok)
    return ck, count_params(cfg)


def run(cmd: list[str]) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, peak RSS bytes, return code) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        print(f"  {' '.join(cmd[3:5])} failed ({rc}): {err.strip().splitlines()[-1:]}", file=sys.stderr)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="400m")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--skip-onnx", action="store_true")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT", help="run only formats whose label contains TEXT")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_export-"))
    try:
        t0 = time.perf_counter()
        ck, n_params = make_checkpoint(args.preset, work)
        print(f"{args.preset}: {n_params / 1e6:.0f} M params, checkpoint written in {time.perf_counter() - t0:.0f} s "
              f"({os.cpu_count()} CPUs)", file=sys.stderr)
        fp32 = (ck / "model.safetensors").stat().st_size
        cases = [("HF safetensors (fp32)", ["safetensors"]), ("GGUF F32", ["gguf", "--f32"]),
                 ("GGUF F16", ["gguf", "--f16"]), ("GGUF Q8_0", ["gguf", "--q8"]),
                 ("GGUF Q4_K_M (via temporary F32)", ["gguf", "--q4"])]
        if not args.skip_onnx:
            cases.append(("ONNX fp32", ["onnx"]))
        # graph traced over placeholder weights, weights streamed to external data (export/onnx_stream.py)
        cases.append(("ONNX fp32 (streamed)", ["export.onnx_stream"]))
        if args.only:
            cases = [c for c in cases if any(o in c[0] for o in args.only)]
        rows = ["| format | wall time (s) | CPU time (s) | peak RSS (GiB) | RSS / fp32 size | file size (GiB) | target |",
                "|---|---:|---:|---:|---:|---:|---|"]
        ok = True
        for i, (label, cmd) in enumerate(cases):
            out = work / f"out{i}"
            if cmd[0] == "export.onnx_stream":
                wall, cpu, rss, rc = run([sys.executable, "-m", cmd[0], str(ck), "--out", str(out), *cmd[1:]])
            else:
                wall, cpu, rss, rc = run([sys.executable, "-m", "export", *cmd[:1], str(ck), "--out", str(out),
                                          "--no-parity", *cmd[1:]])
            size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.suffix in (".gguf", ".safetensors", ".onnx", ".onnx_data", ".data"))
            target = ""
            if "Q4_K_M" in label or "streamed" in label:
                met = wall <= TARGET_Q4_S and rss <= TARGET_RSS_RATIO * fp32
                ok &= met
                target = f"<= {TARGET_Q4_S:.0f} s, <= {TARGET_RSS_RATIO:g}x: {'met' if met else 'MISSED'}"
            status = "" if rc == 0 else f" (exit {rc})"
            rows.append(f"| {label}{status} | {wall:.1f} | {cpu:.1f} | {rss / GiB:.2f} | {rss / fp32:.2f} | {size / GiB:.2f} | {target} |")
            shutil.rmtree(out, ignore_errors=True)
            print(rows[-1], file=sys.stderr, flush=True)
        load = os.getloadavg()[0]
        print(f"\nExport of the {args.preset} preset ({n_params / 1e6:.0f} M params, fp32 checkpoint "
              f"{fp32 / GiB:.2f} GiB), {os.cpu_count()} CPUs, load average {load:.1f} at the end:\n")
        print("\n".join(rows))
        return 0 if ok else 1
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

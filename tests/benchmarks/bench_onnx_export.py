"""Benchmark: the streamed ONNX export (export/onnx/onnx_export.py) of a preset, fp32 alone and with int8 / int4:
wall and CPU time, peak RSS against the fp32 checkpoint size, file sizes, the export's own checks.

    .venv/bin/python tests/benchmarks/bench_onnx_export.py [--preset 400m] [--work DIR] [--no-check]
    .venv/bin/python tests/benchmarks/bench_onnx_export.py --preset small --speed [--threads 1]

Builds a random-init checkpoint of the preset (export time and memory do not depend on the weights)
with a tokenizer trained on ../shared/data/bn/train (the bundled corpus when absent; the model's
vocabulary is the tokenizer's), then runs each export as its own `python -m export.onnx_stream`
process, so its peak RSS (ru_maxrss from os.wait4) is that export's alone. Target (issue 18):
<= 60 s and <= 2x the fp32 size in peak RSS. Prints a Markdown table.

--speed instead exports fp32/int8/int4 with the ONNX Runtime GenAI files and compares, on the same
model files, greedy decoding by ONNX Runtime GenAI (export.onnx.genai.genai_generate_speed) and by our
ONNX Runtime backend (serving.backends.onnxrt_backend): time to first token and decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SHARED_BN = REPO.parent / "shared" / "data" / "bn" / "train"
BUNDLED = REPO / "training" / "assets" / "corpus"
TOKENIZER_LINES = 20000
TARGET_S, TARGET_RSS_RATIO = 60.0, 2.0
GiB = 1 << 30
PROMPT_TOKENS, NEW_TOKENS = 64, 32
CASES = (("fp32", []), ("fp32 + int8", ["--int8"]), ("fp32 + int4", ["--int4"]))


def make_checkpoint(preset_name: str, work: Path) -> Path:
    import torch

    from training.checkpoint import checkpoint_io as checkpoint
    from training.model.decoder import Transformer, preset
    from training.text.normalization import normalize
    from training.text.tokenizer import train_tokenizer

    if (work / "run").is_dir() and (done := checkpoint.latest(work / "run")) is not None:
        return done  # a kept --work folder: reuse its checkpoint
    files = sorted(SHARED_BN.rglob("*.*")) if SHARED_BN.is_dir() else sorted(BUNDLED.glob("bn_*.txt"))
    lines = [normalize(x) for f in files for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    tok = train_tokenizer(lines[:TOKENIZER_LINES], preset(preset_name).vocab_size, num_threads=os.cpu_count() or 1)
    cfg = preset(preset_name, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    model = Transformer(cfg)
    return checkpoint.save(work / "run", 0, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg,
                           tokenizer=tok)


def run(cmd: list[str]) -> tuple[float, float, int, int, str]:
    """(wall s, CPU s, peak RSS bytes, exit status, last stderr line) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode(errors="replace").strip().splitlines() if proc.stderr else []
    return (time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024,
            os.waitstatus_to_exitcode(status), err[-1] if err else "")


def ours_speed(onnx_dir: Path, variant: str, ids: list[int], new_tokens: int, threads: int) -> tuple[float, float]:
    """(time to first token s, decode tokens/s) of serving.backends.onnxrt_backend on one variant, measured as
    genai_generate_speed measures GenAI: end-of-turn ignored, best of 2 after a warm-up."""
    from serving.backend import SamplingParams
    from serving.backends.onnxrt_backend import OnnxBackend

    b = OnnxBackend(onnx_dir, threads=threads, variant=variant)
    b.eos_ids = ()  # fixed-length decode
    first, rate = float("inf"), 0.0
    for _ in range(3):
        it = b.generate(ids, SamplingParams.greedy(new_tokens))
        t0 = time.perf_counter()
        next(it)
        t1 = time.perf_counter()
        n = sum(1 for _ in it)
        first, rate = min(first, t1 - t0), max(rate, n / max(time.perf_counter() - t1, 1e-9))
    b.close()
    return first, rate


def speed(ck: Path, work: Path, threads: int) -> None:
    from export.onnx.genai import GENAI_DIR, genai_generate_speed
    from export.onnx.onnx_export import export_onnx
    from training.checkpoint.checkpoint_io import load

    out = work / "onnx-speed"
    export_onnx(ck, out, int8=True, int4=True, force=True, genai=True)
    tok = load(ck).tokenizer
    text = " ".join(x for f in sorted(BUNDLED.glob("bn_*.txt")) for x in f.read_text(encoding="utf-8").splitlines())
    ids = tok.encode(text, bos=True)[:PROMPT_TOKENS]
    print("| variant | GenAI first token (ms) | ours first token (ms) | GenAI decode tok/s | ours decode tok/s |\n"
          "|---|---:|---:|---:|---:|")
    for v in ("fp32", "int8", "int4"):
        g = genai_generate_speed(out / GENAI_DIR / v, ids, NEW_TOKENS, threads=threads)
        first, rate = ours_speed(out, v, ids, NEW_TOKENS, threads)
        print(f"| {v} | {g.ttft_s * 1e3:.0f} | {first * 1e3:.0f} | {g.tokens_per_s:.1f} | {rate:.1f} |", flush=True)
    print(f"\n{PROMPT_TOKENS}-token Bangla prompt, {NEW_TOKENS} new tokens, {threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="400m")
    ap.add_argument("--work", type=Path, help="keep the checkpoint here (reused by the next run)")
    ap.add_argument("--no-check", action="store_true", help="skip the ONNX Runtime vs PyTorch check")
    ap.add_argument("--only", action="append", default=[], help="run only cases whose label contains this")
    ap.add_argument("--speed", action="store_true", help="GenAI vs our ONNX Runtime backend decode speed instead")
    ap.add_argument("--threads", type=int, default=1, help="with --speed: intra-op threads of both")
    return ap


def main() -> int:
    from training.model.decoder import count_params

    args = build_parser().parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_onnx-"))
    try:
        t0 = time.perf_counter()
        ck = make_checkpoint(args.preset, work)
        from training.checkpoint.checkpoint_io import load

        cfg = load(ck).config
        if args.speed:
            speed(ck, work, args.threads)
            return 0
        print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        fp32 = (ck / "model.safetensors").stat().st_size
        rows = ["| export | wall (s) | CPU (s) | peak RSS (GiB) | RSS / fp32 | files (GiB) | stages (s) | probe KL / top-1 | target |",
                "|---|---:|---:|---:|---:|---:|---|---|---|"]
        ok = True
        for label, flags in CASES:
            if args.only and not any(o in label for o in args.only):
                continue
            out = work / "onnx"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "export.onnx_stream", str(ck), "--out", str(out), *flags]
            wall, cpu, rss, rc, err = run(cmd + (["--no-check"] if args.no_check else []))
            if rc != 0:
                rows.append(f"| {label} (exit {rc}: {err}) | {wall:.1f} | {cpu:.1f} | {rss / GiB:.2f} | | | | | |")
                ok = False
                continue
            meta = json.loads((out / "onnx_config.json").read_text())
            size = sum(p.stat().st_size for p in out.iterdir() if p.suffix in (".onnx", ".onnx_data", ".data"))
            stages = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in meta["timings_s"].items())
            q = [meta["checks"][v] for v in ("int8", "int4") if v in meta["checks"]]
            quality = "; ".join(f"{c['kl_mean']:.1e} / {c['top1_agreement']:.2f}" for c in q) or "—"
            met = wall <= TARGET_S and rss <= TARGET_RSS_RATIO * fp32
            ok &= met
            rows.append(f"| {label} | {wall:.1f} | {cpu:.1f} | {rss / GiB:.2f} | {rss / fp32:.2f} | {size / GiB:.2f} | "
                        f"{stages} | {quality} | {'met' if met else 'MISSED'} |")
            print(rows[-1], file=sys.stderr, flush=True)
        print(f"\nStreamed ONNX export of `{args.preset}` ({count_params(cfg) / 1e6:.0f} M params, vocab {cfg.vocab_size}, "
              f"random init; fp32 checkpoint {fp32 / GiB:.2f} GiB), {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f} at the end; target <= {TARGET_S:.0f} s and <= {TARGET_RSS_RATIO:g}x fp32 in RSS:\n")
        print("\n".join(rows))
        return 0 if ok else 1
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

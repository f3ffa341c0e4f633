"""Benchmark: ONNX export time, file sizes and ONNX Runtime speed per variant, for a preset (default `small`).

    .venv/bin/python tests/benchmarks/bench_onnx_export.py [--preset small] [--threads 1] [--keep DIR]

Builds an untrained checkpoint of the preset (export time does not depend on the weights) with a
tokenizer trained on ../shared/data/bn/train (the bundled corpus when absent; the model's vocabulary
is the tokenizer's), runs `export.onnx.export_onnx` with int8 and int4, and prints a Markdown table:
stage times, file sizes, prompt (128 tokens) and decode (one token through the KV cache) speed in
ONNX Runtime, and KL(fp32 || variant) on the export's probe text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from export.onnx import export_onnx  # noqa: E402
from serving.backend import SamplingParams  # noqa: E402
from serving.onnxrt import OnnxBackend  # noqa: E402
from training import checkpoint  # noqa: E402
from training.model import Transformer, count_params, preset  # noqa: E402
from training.text import normalize  # noqa: E402
from training.tokenizer import train_tokenizer  # noqa: E402

SHARED_BN = REPO.parent / "shared" / "data" / "bn" / "train"
BUNDLED = REPO / "training" / "assets" / "corpus"
TOKENIZER_LINES = 20000
PROMPT_TOKENS, DECODE_TOKENS = 128, 32


def lines() -> list[str]:
    files = sorted(SHARED_BN.rglob("*.*")) if SHARED_BN.is_dir() else sorted(BUNDLED.glob("bn_*.txt"))
    out: list[str] = []
    for f in files:
        out += [normalize(x) for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    return out[:TOKENIZER_LINES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="export here (kept) instead of a temporary folder")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    base = preset(args.preset)
    t0 = time.perf_counter()
    tok = train_tokenizer(lines(), base.vocab_size, num_threads=args.threads)
    tok_s = time.perf_counter() - t0
    cfg = preset(args.preset, vocab_size=tok.vocab_size)
    model = Transformer(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        checkpoint.save(run, 0, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg, tokenizer=tok)
        out = args.keep or Path(tmp) / "onnx"
        t0, c0 = time.perf_counter(), time.process_time()
        export_onnx(run, out, int8=True, int4=True, force=True)
        total_s, total_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        meta = json.loads((out / "onnx_config.json").read_text())
        prompt = (tok.encode(" ".join(lines()[:50]), bos=True) * 4)[:PROMPT_TOKENS]
        rows = []
        for variant in ("fp32", "int8", "int4"):
            b = OnnxBackend(out, threads=args.threads, variant=variant)
            b.eos_ids = ()  # fixed-length decode
            b.logits(prompt)  # warm-up
            t0 = time.perf_counter()
            b.logits(prompt)
            prompt_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            n = len(list(b.generate(prompt[:8], SamplingParams.greedy(DECODE_TOKENS))))
            decode_s = time.perf_counter() - t0
            f = out / meta["files"][variant]
            size = f.stat().st_size + sum(p.stat().st_size for p in out.glob(f.name + ".data"))
            kl = meta["checks"].get(variant, {}).get("kl_mean")
            rows.append((variant, size / 1e6, PROMPT_TOKENS / prompt_s, n / decode_s, kl))
            b.close()

    t = meta["timings_s"]
    print(f"## ONNX export: preset `{args.preset}` ({count_params(cfg) / 1e6:.1f} M params, vocab {cfg.vocab_size}), "
          f"torch {torch.__version__}, onnxruntime {meta['versions']['onnxruntime']}, {args.threads} thread(s)\n")
    print("| stage | seconds |\n| --- | ---: |")
    print(f"| tokenizer training (not export) | {tok_s:.1f} |")
    print(f"| torch.onnx.export (dynamo) | {t['fp32_export_s']:.1f} |")
    print(f"| int8 quantize_dynamic | {t['int8_quantize_s']:.1f} |")
    print(f"| int4 MatMulNBits | {t['int4_quantize_s']:.1f} |")
    print(f"| export_onnx total (load, export, checker, checks, both variants) | {total_s:.1f} |")
    print(f"| ... of which CPU time of this process (wall exceeds it on a busy machine) | {total_cpu_s:.1f} |\n")
    print("| variant | file MB | prompt tok/s (128) | decode tok/s | KL(fp32‖variant) probe |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for v, mb, ps, ds, kl in rows:
        print(f"| {v} | {mb:.1f} | {ps:.0f} | {ds:.1f} | {'—' if kl is None else f'{kl:.2e}'} |")
    print(f"\nfp32 max |ONNX − PyTorch| at export: {meta['checks']['fp32']['max_abs_diff_vs_torch']:.2e}")


if __name__ == "__main__":
    main()

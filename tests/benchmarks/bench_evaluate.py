"""Benchmark: quantization loss as bits-per-byte and accuracy deltas, GGUF and ONNX against PyTorch.

    .venv/bin/python tests/benchmarks/bench_evaluate.py [RUN] [--limit 40] [--keep DIR] [--no-onnx]
        [--text FILE] [--mc FILE]

Without RUN, trains the suite's tiny run (conftest's `tiny_run` recipe: training.prepare and the real
train.py on training/assets/corpus). Exports GGUF F32/F16/Q8_0/Q4_K_M (export.gguf.gguf_export: gguf-py writer,
llama.cpp's quantizer) and ONNX fp32/int8 (export.onnx.onnx_export), then scores every file and the checkpoint
with `python -m export.evaluate`, by default on the held-out text and Bangla multiple-choice set
that ship in training/assets/eval (for breadth: --text ../shared/data/bn/dev/tatoeba_bn.txt
--mc ../shared/data/eval/bn_mc/okapi__m_arc__bn_validation.json). Prints a Markdown table:
bits/byte, Δ bits/byte, accuracy, Δ accuracy, scoring time.
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
sys.path.insert(0, str(REPO / "tests"))

from conftest import CORPUS, run_train  # noqa: E402
from fixtures_evaluate import HELDOUT, MC_BN  # noqa: E402

from export.evaluate import main as export_evaluate  # noqa: E402
from export.gguf.gguf_export import quantize_gguf, write_gguf  # noqa: E402
from export.manifest import load_source  # noqa: E402

GGUF_TYPES = ("F16", "Q8_0", "Q4_K_M")
DOC_CHARS = 1024


def build_tiny_run(root: Path) -> Path:
    """conftest's bn_data + tiny_run, outside pytest: prepare the shipped corpus, train 300 steps."""
    from training.prepare import prepare

    data, run = root / "data", root / "run"
    prepare([CORPUS], data, vocab_size=2048, progress=False, workers=1, fertility_floor=1.5)
    run_train("--preset", "tiny", "--data", str(data), "--out", str(run), "--max-steps", "300",
              "--batch-size", "8", "--seq-len", "128", "--lr", "3e-3", "--warmup-steps", "20",
              "--eval-every", "100", "--save-every", "300", "--log-every", "100")
    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="?", help="a run/checkpoint folder (default: train the tiny test run)")
    ap.add_argument("--limit", type=int, default=40, help="text documents and MC items scored")
    ap.add_argument("--keep", type=Path, default=None, help="keep the exports and reports here")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per backend")
    ap.add_argument("--no-onnx", action="store_true", help="skip the (slow) ONNX export")
    ap.add_argument("--text", type=Path, default=HELDOUT, help="held-out text (default: the shipped one)")
    ap.add_argument("--mc", type=Path, default=MC_BN, help="one multiple-choice file (default: the shipped Bangla set)")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_eval_"))
    root.mkdir(parents=True, exist_ok=True)
    run = Path(args.run) if args.run else build_tiny_run(root)
    src = load_source(run)
    files: list[Path] = []
    t0 = time.perf_counter()
    f32 = write_gguf(src, root / "gguf" / f"{src.name}-F32.gguf", "F32")
    files.append(f32)
    for t in GGUF_TYPES:
        files.append(write_gguf(src, root / "gguf" / f"{src.name}-{t}.gguf", t) if t == "F16"
                     else quantize_gguf(f32, root / "gguf" / f"{src.name}-{t}.gguf", t))
    if not args.no_onnx:
        from export.onnx.onnx_export import export_onnx

        files += [p for p in export_onnx(run, root / "onnx", int8=True, force=True) if p.suffix == ".onnx"]
    export_s = time.perf_counter() - t0
    out = root / "eval"
    rc = export_evaluate([*map(str, files), "--reference", str(run), "--text", str(args.text), "--mc", str(args.mc),
                          "--limit", str(args.limit), "--max-doc-chars", str(DOC_CHARS), "--threads", str(args.threads),
                          "--out", str(out), "--force", "--no-progress"])
    if rc:
        return rc
    report = json.loads((out / "eval.json").read_text())
    mc_name = next(iter(report["mc_files"]))
    print(f"\nexports took {export_s:.1f} s; text: {args.text.name} (first {args.limit} documents of {DOC_CHARS} chars), "
          f"MC: {mc_name} ({args.limit} items), {args.threads} thread(s)\n")
    print("| model | bits/byte (all) | Δ bits/byte | acc | Δ acc | acc_norm (byte) | scoring s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m in report["models"]:
        lm, mc = m["lm"]["all"], m["mc"][mc_name]
        d = m.get("delta", {})
        dbpb = d.get("bits_per_byte", {}).get("all")
        dacc = d.get("acc", {}).get(mc_name)
        print(f"| {m['name']} | {lm['bits_per_byte']:.4f} | {'' if dbpb is None else f'{dbpb:+.4f}'} | "
              f"{mc['acc']['value']:.3f} | {'' if dacc is None else f'{dacc:+.3f}'} | "
              f"{mc['acc_norm_byte']['value']:.3f} | {m['seconds']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

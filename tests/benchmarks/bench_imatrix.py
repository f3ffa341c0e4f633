"""Benchmark: what an importance matrix buys, per GGUF type, on held-out Bangla.

    .venv/bin/python tests/benchmarks/bench_imatrix.py RUN [--text CALIB] [--heldout FILE]
        [--types Q4_K_M,Q5_K_M,Q6_K,IQ4_XS] [--chunk 256] [--no-head] [--embedding-type F16]
        [--keep DIR] [--json FILE]

For every type: plain (llama.cpp's quantizer, as `python -m export gguf` makes it) and imatrix
(`llama-imatrix` on the calibration text, plus the tied head's entry from the PyTorch model unless
--no-head; `llama-quantize --imatrix`). Each file is scored against the PyTorch fp32 checkpoint over
every position of the held-out text cut into context-length windows (tests/test_imatrix.py's
`heldout_kl`): mean KL(fp32 || quantized) in nats and top-1 agreement. Prints a Markdown table with
the ratio imatrix/plain. Needs llama.cpp's tools (`bash scripts/build_llama_tools.sh`).

--embedding-type F16 keeps token_embd at F16 in both files (llama-quantize's --token-embedding-type):
with tied embeddings token_embd is also the output head, which Q4_K_M stores as Q6_K and an importance
matrix does not improve, so this separates the error the imatrix can act on (the blocks' matmuls)
from the head's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_imatrix import HELDOUT, heldout_kl, heldout_windows  # noqa: E402

from export.gguf.gguf_export import quantize_gguf, write_gguf  # noqa: E402
from export.gguf.imatrix_format import DEFAULT_CHUNK_TOKENS, write_imatrix  # noqa: E402
from export.gguf.imatrix_torch import add_head_importance, torch_importance  # noqa: E402
from export.imatrix import DEFAULT_CALIBRATION, compute_imatrix, quantize_with_imatrix  # noqa: E402
from export.manifest import load_source  # noqa: E402
from serving.backends.llamacpp_backend import LlamaCppBackend  # noqa: E402
from serving.backends.torch_backend import TorchBackend  # noqa: E402

TYPES = "Q4_K_M,Q5_K_M,Q6_K,IQ4_XS"
IMPORTANCE = ("llama", "activation", "fisher", "uniform")


def score(path: Path, ref: TorchBackend, windows: list[list[int]]) -> tuple[float, float]:
    b = LlamaCppBackend(path, threads=1)
    try:
        return heldout_kl(ref, b, windows)
    finally:
        b.close()


def importance_file(run: Path, f32: Path, out: Path, *, text: Path, chunk: int, head: bool, importance: str) -> Path:
    """llama-imatrix's file (+ the tied head's entry), or one written from the PyTorch model:
    activation / fisher statistics (export.gguf.imatrix_torch.torch_importance), or `uniform` (every weight 1:
    only the imatrix code path of llama.cpp's quantizer, no statistics)."""
    if importance == "llama":
        im = compute_imatrix(f32, text, out, chunk_tokens=chunk, force=True)
        if head:
            add_head_importance(im, run, text, chunk_tokens=chunk)
        return im
    entries = torch_importance(run, text, chunk_tokens=chunk, weighting="activation" if importance == "uniform" else importance)
    if not head:
        entries.pop("token_embd.weight", None)
    if importance == "uniform":
        entries = {k: (np.ones_like(s), c) for k, (s, c) in entries.items()}
    out.unlink(missing_ok=True)
    return write_imatrix(entries, out, datasets=[text.name], chunk_count=1, chunk_size=chunk)


def bench(run: Path, work: Path, *, text: Path, heldout: Path, types: list[str], chunk: int, head: bool,
          importance: str = "llama", embedding_type: str | None = None) -> dict:
    src = load_source(run)
    t0 = time.perf_counter()
    f32 = write_gguf(src, work / "m-F32.gguf", "F32")
    im = importance_file(run, f32, work / "m.imatrix.gguf", text=text, chunk=chunk, head=head, importance=importance)
    t_imatrix = time.perf_counter() - t0
    ref = TorchBackend(run, threads=1)
    windows = heldout_windows(ref.tokenize(heldout.read_text(encoding="utf-8")), ref.tokenizer.bos_id, ref.n_ctx)
    rows = []
    for t in types:
        plain = quantize_gguf(f32, work / f"m-{t}.gguf", t, embedding_type=embedding_type)
        weighted = quantize_with_imatrix(f32, work / f"m-im-{t}.gguf", t, im, force=True, embedding_type=embedding_type)
        (kp, tp), (kw, tw) = score(plain, ref, windows), score(weighted, ref, windows)
        rows.append({"type": t, "kl_plain": kp, "kl_imatrix": kw, "ratio": kw / kp, "top1_plain": tp,
                     "top1_imatrix": tw})
    return {"run": str(run), "step": src.step,
            "calibration": text.name, "heldout": heldout.name, "chunk": chunk, "head": head, "importance": importance,
            "embedding_type": embedding_type, "positions": sum(len(w) for w in windows), "imatrix_s": round(t_imatrix, 1), "rows": rows}


def table(res: dict) -> str:
    out = [f"{res['run']} (step {res['step']}), calibration {res['calibration']}, held-out {res['heldout']} "
           f"({res['positions']} positions), chunk {res['chunk']}, importance {res['importance']}, "
           f"head entry {res['head']}, token_embd {res.get('embedding_type') or 'as the type mixes it'}", "",
           "| type | KL plain | KL imatrix | ratio | top-1 plain | top-1 imatrix |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['type']} | {r['kl_plain']:.3e} | {r['kl_imatrix']:.3e} | {r['ratio']:.3f} | "
                   f"{r['top1_plain']:.1%} | {r['top1_imatrix']:.1%} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--text", type=Path, default=DEFAULT_CALIBRATION)
    ap.add_argument("--heldout", type=Path, default=HELDOUT)
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_TOKENS)
    ap.add_argument("--no-head", action="store_true", help="only llama-imatrix's entries (no tied-head entry)")
    ap.add_argument("--importance", default="llama", choices=IMPORTANCE,
                    help="llama: llama-imatrix; activation/fisher: from the PyTorch model; uniform: all ones")
    ap.add_argument("--embedding-type", metavar="GGML_TYPE",
                    help="token_embd's type in both files (e.g. F16), instead of the type's mix")
    ap.add_argument("--keep", type=Path, help="keep the GGUF files here")
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        work = a.keep or Path(td)
        work.mkdir(parents=True, exist_ok=True)
        res = bench(a.run, work, text=a.text, heldout=a.heldout, types=a.types.split(","), chunk=a.chunk,
                    head=not a.no_head, importance=a.importance, embedding_type=a.embedding_type)
    print(table(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

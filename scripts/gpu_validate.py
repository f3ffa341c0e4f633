"""One-command GPU validation (<= 8 minutes on one H100/H200):

    python scripts/gpu_validate.py [--preset 400m] [--seq-len 2048] [--batch-size 16] [--steps 40] [--hourly-usd 3.0]

1. prepares a data folder from the shipped corpus (tokenizer + shards; random-token shards are
   appended so the loader never repeats windows during the timing run),
2. runs `training/train.py` with the pre-flight gates ON (gradient flow, compiled vs eager,
   overfit, throughput with its MFU floor and backward/forward ratio, data, tokenizer) and a short
   `400m` run with bf16 autocast, torch.compile, fused AdamW and SDPA flash attention,
3. prints tokens/s, MFU (6N + attention FLOPs per token over the GPU's peak dense bf16 FLOP/s),
   peak memory, backward/forward ratio, and the projected time and cost of 2 B tokens,
   and writes them to RUN/gpu_validate.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import numpy as np
    import torch

    from training.data import ShardWriter
    from training.metrics import peak_flops
    from training.model import count_params, flops_per_token, preset
    from training.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="400m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hourly-usd", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/prodip-gpu-validate"))
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device; this script validates the GPU path", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    data = a.out / "data"
    py = sys.executable
    if not (data / "meta.json").is_file():
        subprocess.check_call([py, "-m", "training.prepare", "--input", str(ROOT / "training/assets/corpus"),
                               "--out", str(data), "--vocab-size", "8192", "--force"], cwd=ROOT)
        # pad the train split with random tokens: timing needs more windows than the small corpus has
        tok = Tokenizer.load(data / "tokenizer.model")
        meta = json.loads((data / "meta.json").read_text())
        need = a.steps * a.batch_size * a.grad_accum * a.seq_len * 3
        w = ShardWriter(data / "train_pad", tok.vocab_size, tok.sha256, shard_tokens=need)
        w.add(np.random.default_rng(0).integers(6, tok.vocab_size, need))
        w.close()
        n = meta["splits"]["train"]["n_shards"]
        for i, f in enumerate(sorted((data / "train_pad").glob("shard_*.bin"))):
            f.rename(data / "train" / f"shard_{n + i:05d}.bin")
        meta["splits"]["train"]["n_tokens"] += need
        (data / "meta.json").write_text(json.dumps(meta, indent=2))
    run = a.out / f"run-{int(time.time())}"
    cmd = [py, str(ROOT / "training/train.py"), "--preset", a.preset, "--data", str(data), "--out", str(run),
           "--max-steps", str(a.steps), "--batch-size", str(a.batch_size), "--grad-accum", str(a.grad_accum),
           "--seq-len", str(a.seq_len), "--lr", "1e-3", "--warmup-steps", "5", "--eval-every", "0",
           "--save-every", "0", "--log-every", "5", "--device", "cuda", "--gpu-hourly-usd", str(a.hourly_usd)]
    if not a.no_compile:
        cmd.append("--compile")
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT)
    wall = time.time() - t0
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()] if (run / "log.jsonl").exists() else []
    gates = json.loads((run / "gates.json").read_text()) if (run / "gates.json").exists() else {}
    steady = [r for r in recs if r.get("tokens_per_s")][len(recs) // 2:]  # after compile warm-up
    tps = float(np.median([r["tokens_per_s"] for r in steady])) if steady else float("nan")
    cfg = preset(a.preset)
    peak, name = peak_flops(torch.device("cuda"))
    fpt = flops_per_token(cfg, a.seq_len)
    mfu = tps * fpt / peak if peak else None
    bwd_fwd = next((g["value"] for g in gates.get("results", []) if g["name"] == "throughput.backward_forward_ratio"), None)
    hours_2b = 2e9 / tps / 3600 if tps == tps else float("nan")
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": name, "torch": torch.__version__, "preset": a.preset,
           "params": count_params(cfg), "seq_len": a.seq_len, "batch_size": a.batch_size, "grad_accum": a.grad_accum,
           "compile": not a.no_compile, "exit_code": rc, "wall_s": round(wall, 1), "tokens_per_s": round(tps),
           "flops_per_token": fpt, "peak_flops": peak, "mfu": mfu,
           "mfu_formula": "tokens/s * (6 * N_nonembedding+head + 6 * n_layers * seq_len * d_attn) / peak dense bf16 FLOP/s",
           "peak_mem_gb": max((r.get("peak_mem_gb", 0) for r in recs), default=None),
           "backward_forward_ratio": bwd_fwd, "gates_passed": gates.get("passed"),
           "projected_2B_tokens_hours": round(hours_2b, 2), "projected_2B_tokens_usd": round(hours_2b * a.hourly_usd, 2)}
    (run / "gpu_validate.json").write_text(json.dumps(res, indent=2))
    md = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in res.items()]
    (run / "gpu_validate.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return rc


if __name__ == "__main__":
    sys.exit(main())

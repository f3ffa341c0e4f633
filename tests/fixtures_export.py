"""Fixtures for the export and parity tests: a tiny Bangla run trained for real, cached across sessions.

DATA comes from the real CLI (`python -m training.prepare` on ../shared/data/bn/train/majantali_bnarchive,
vocab 2048). The model ("tiny" preset: d_model 256, so K-quants apply without fallback) is trained by
a short AdamW loop over DATA's shards written here, not by training/train.py: its per-step gates and
evaluation make 300 steps take minutes on two shared cores, and this fixture must stay well under a
minute. It is saved with training.checkpoint.save, with RUN_DIR/config.json naming DATA (the model
card reads the fertility report from there) and a gates.json.

The run is cached in pytest's cache folder, keyed by a hash of the code it depends on, so repeated
sessions skip the ~1 minute of training; `pytest --cache-clear` rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SHARED_DATA

ROOT = REPO
SHARED = SHARED_DATA
CORPUS = SHARED / "bn" / "train" / "majantali_bnarchive"
TATOEBA = SHARED / "bn" / "dev" / "tatoeba_bn.txt"
VOCAB = 2048
STEPS, BATCH, SEQ, LR, WARMUP, SEED = 240, 8, 128, 4e-3, 20, 0
FIXTURE_VERSION = 1
DEPENDS = ("training/model.py", "training/tokenizer.py", "training/checkpoint.py", "training/data.py",
           "training/prepare.py", "training/text.py")


def cache_key() -> str:
    h = hashlib.sha256(f"{FIXTURE_VERSION}-{VOCAB}-{STEPS}-{BATCH}-{SEQ}-{LR}-{WARMUP}-{SEED}".encode())
    for rel in DEPENDS:
        h.update((ROOT / rel).read_bytes())
    return h.hexdigest()[:16]


def prepare(data_dir: Path) -> None:
    cmd = [sys.executable, "-m", "training.prepare", "--input", str(CORPUS), "--out", str(data_dir),
           "--vocab-size", str(VOCAB), "--workers", "1", "--no-progress", "--force"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"training.prepare failed:\n{r.stderr[-2000:]}")


def train(data_dir: Path, run_dir: Path) -> Path:
    from training import checkpoint
    from training.data import TokenStream, WindowLoader
    from training.model import Transformer, preset
    from training.tokenizer import Tokenizer

    torch.manual_seed(SEED)
    tok = Tokenizer.load(data_dir / "tokenizer.model")
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    loader = WindowLoader(TokenStream(data_dir, "train"), SEQ, seed=SEED)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / WARMUP) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / STEPS))))
    model.train()
    losses = []
    for _ in range(STEPS):
        x, y = loader.next_batch(BATCH)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"kind": "pretrain", "model": cfg.to_dict(),
                                                     "train": {"data": str(data_dir), "max_steps": STEPS}}))
    (run_dir / "gates.json").write_text(json.dumps({"passed": True, "summary": "all 1 gates passed",
                                                    "skipped_by_user": [], "results": [
        {"name": "loss_decreased", "passed": losses[-1] < losses[0], "value": losses[-1],
         "threshold": f"< {losses[0]:.3f}", "detail": "fixture loop", "skipped": False}]}))
    checkpoint.save(run_dir, STEPS, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg,
                    tokenizer=tok, state={"first_loss": losses[0], "final_loss": sum(losses[-10:]) / 10})
    return run_dir


def build(root: Path) -> Path:
    run_dir = root / "run"
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step_*")):
        return run_dir
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prepare(root / "data")
        return train(root / "data", run_dir)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def trained_run(request) -> Path:
    """RUN_DIR of the trained tiny run (skips when ../shared/data is absent)."""
    if not CORPUS.is_dir():
        pytest.skip(f"real Bangla text not found at {CORPUS} (../shared/data beside the repo)")
    root = Path(request.config.cache.mkdir(f"prodip-export-run-{cache_key()}"))
    return build(root)


@pytest.fixture(scope="session")
def exported(trained_run, tmp_path_factory) -> Path:
    """The trained run exported to HF + GGUF F32/F16/Q8_0/Q4_K_M (no parity yet); the out dir."""
    from export.gguf import export_gguf
    from export.hf import export_hf
    from export.manifest import Manifest, load_source

    out = tmp_path_factory.mktemp("export")
    src = load_source(trained_run)
    man = Manifest.open(out, src, force=False)
    export_hf(src, out, man)
    export_gguf(src, out, ["F32", "F16", "Q8_0", "Q4_K_M"], man)
    man.save()
    return out


if __name__ == "__main__":  # build a run by hand: python tests/fixtures_export.py DIR
    print(build(Path(sys.argv[1])))

"""Fixtures for the ONNX export / serving tests: a tiny Bangla model trained for real, exported once.

Text: a few thousand lines of Bangla from ../shared/data/bn/train when present, else the Bangla text
bundled with the package (training/assets/corpus), so the exactness tests never skip. The tokenizer
(vocab 1024) and a "tiny" model trained a few dozen AdamW steps are saved with training.checkpoint,
then exported by export.onnx with the int8 and int4 variants.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, SHARED_DATA

from training import checkpoint
from training.model import Transformer, preset
from training.text import normalize
from training.tokenizer import train_tokenizer

ROOT = REPO
SHARED_BN = SHARED_DATA / "bn" / "train"
BUNDLED = ROOT / "training" / "assets" / "corpus"
MAX_LINES = 4000
MIN_CHARS = 20  # shorter lines are mostly headings and markup crumbs
VOCAB = 1024
SEQ, BATCH, STEPS, LR, SEED = 128, 8, 40, 3e-3, 0


def bangla_lines() -> list[str]:
    files = sorted(SHARED_BN.rglob("*.*")) if SHARED_BN.is_dir() else []
    files = files or sorted(BUNDLED.glob("bn_*.txt"))
    per_file = MAX_LINES // len(files) + 1  # a mix of works, not the first book only
    lines: list[str] = []
    for f in files:
        kept = [x for x in (normalize(y.strip()) for y in f.read_text(encoding="utf-8").splitlines())
                if len(x) > MIN_CHARS]
        lines += kept[:per_file]
    return lines[:MAX_LINES]


def build_run(run_dir: Path) -> Path:
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    lines = bangla_lines()
    tok = train_tokenizer(lines, VOCAB, num_threads=1)
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    stream: list[int] = []
    for x in lines:
        stream += tok.encode(x, bos=True, eos=True)
    data = torch.tensor(stream, dtype=torch.long)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    for _ in range(STEPS):
        starts = [rng.randrange(0, len(data) - SEQ - 1) for _ in range(BATCH)]
        x = torch.stack([data[s:s + SEQ] for s in starts])
        y = torch.stack([data[s + 1:s + SEQ + 1] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    checkpoint.save(run_dir, STEPS, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg,
                    tokenizer=tok, state={"final_loss": float(loss.detach())})
    return run_dir


@pytest.fixture(scope="session")
def onnx_run(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_run(tmp_path_factory.mktemp("onnx") / "run")


@pytest.fixture(scope="session")
def onnx_export(onnx_run) -> tuple[Path, list[Path]]:
    """(out_dir, files written) of the tiny run exported with fp32, int8 and int4."""
    from export.onnx import export_onnx

    out = onnx_run / "export" / "onnx"
    return out, export_onnx(onnx_run, out, int8=True, int4=True)


@pytest.fixture(scope="session")
def torch_model(onnx_run):
    model, ck = checkpoint.load_model(onnx_run)
    return model, ck


def probe_ids(tok) -> list[int]:
    return tok.encode("সোনার বাংলা, আমি তোমায় ভালোবাসি। আজ সকালে আকাশ মেঘলা ছিল, তবু আমরা নদীর ধারে গেলাম।", bos=True)


def kl_mean(ref: np.ndarray, q: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(q))."""
    lp = torch.log_softmax(torch.from_numpy(ref).double(), -1)
    lq = torch.log_softmax(torch.from_numpy(q).double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def torch_greedy(model, ids: list[int], n: int, eos_ids: tuple[int, ...]) -> list[int]:
    """Greedy continuation by recomputing the full sequence each step (no cache): an independent reference."""
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            if nxt in eos_ids:
                break
            seq.append(nxt)
            out.append(nxt)
    return out

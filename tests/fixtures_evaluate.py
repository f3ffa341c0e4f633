"""Fixtures for tests/test_evaluate.py: a tokenizer from the repo's own corpus, and a tiny trained run.

The trained run: a 1024-piece tokenizer and a ~0.5 M-parameter Llama trained for 150 AdamW steps on
a few thousand lines of ../shared/data/bn/train, saved with training.checkpoint.save (tests skip
when the shared data is absent). The lines after the training slice are held out for evaluation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, SHARED_DATA

from training.checkpoint import save, weights_for_save
from training.model import ModelConfig, Transformer
from training.text import normalize
from training.tokenizer import Tokenizer, train_tokenizer

SHARED = SHARED_DATA
CORPUS = REPO / "training" / "assets" / "corpus"
BN_TRAIN = SHARED / "bn" / "train" / "majantali_bnarchive" / "RabindranathTagore_Prose_GalpaGuchchha_1.md"
TRAIN_LINES = 3000
HELDOUT_LINES = 400
VOCAB = 1024
STEPS = 150
BATCH, SEQ = 16, 64
LR = 3e-3
SEED = 1234

TINY_CFG = dict(vocab_size=VOCAB, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=128)


def corpus_lines() -> list[str]:
    """Bangla and English lines shipped in the repo (never skips)."""
    lines: list[str] = []
    for f in sorted(CORPUS.glob("*.txt")):
        lines += [normalize(s) for s in f.read_text(encoding="utf-8").splitlines() if s.strip()]
    return lines


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """One torch thread: on a shared 2-core machine, 2 threads under contention run ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def corpus_tokenizer() -> Tokenizer:
    return train_tokenizer(corpus_lines(), 400, num_threads=1)


@dataclass
class TinyRun:
    run_dir: Path
    cfg: ModelConfig
    tokenizer: Tokenizer
    model: Transformer
    heldout: list[str]
    heldout_file: Path
    train_seconds: float


def _train(cfg: ModelConfig, stream: np.ndarray) -> Transformer:
    torch.manual_seed(SEED)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(SEED)
    data = torch.from_numpy(stream.astype(np.int64))
    warmup = 15
    model.train()
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = LR * min(1.0, (step + 1) / warmup)
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
        w = torch.stack([data[s: s + SEQ + 1] for s in starts])
        _, loss = model(w[:, :-1], w[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    if not BN_TRAIN.is_file():
        pytest.skip(f"shared data absent ({BN_TRAIN}); the trained-model tests need it")
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _build_run(tmp_path_factory.mktemp("eval_run"), t0)
    finally:
        torch.set_num_threads(threads)


def _build_run(run_dir: Path, t0: float) -> TinyRun:
    raw = [normalize(s) for s in BN_TRAIN.read_text(encoding="utf-8").splitlines() if s.strip()]
    skip = 200  # front matter
    train_lines = raw[skip: skip + TRAIN_LINES]
    heldout = raw[skip + TRAIN_LINES: skip + TRAIN_LINES + HELDOUT_LINES]
    tok = train_tokenizer(train_lines, VOCAB, num_threads=1)
    ids: list[int] = []
    for s in train_lines:
        ids += tok.encode(s, bos=True, eos=True)
    cfg = ModelConfig(**TINY_CFG)
    model = _train(cfg, np.asarray(ids))
    save(run_dir, STEPS, weights=weights_for_save(model.state_dict(), cfg), cfg=cfg, tokenizer=tok,
         state={"tokens": STEPS * BATCH * SEQ})
    heldout_file = run_dir / "heldout_bn.txt"
    heldout_file.write_text("\n".join(heldout) + "\n", encoding="utf-8")
    return TinyRun(run_dir, cfg, tok, model, heldout, heldout_file, time.perf_counter() - t0)

"""Fixtures for tests/test_gates.py: a real prepared data folder (the repo's own corpus through
`training.prepare`) and a PreflightContext built the way the Trainer builds it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, built_once

from training import distributed as D
from training.data.loaders import pretraining_data, read_shard, write_shard
from training.gates.context import PreflightContext
from training.loop.step import autocast_for
from training.model.decoder import Transformer
from training.optim import make_optimizer
from training.prepare import prepare
from training.telemetry.step_metrics import flops_per_token
from training.text.normalization import normalize
from training.text.tokenizer import Tokenizer, train_tokenizer
from training.train_config import TrainConfig

CORPUS = REPO / "training" / "assets" / "corpus"
VOCAB = 1024
BYTE_VOCAB = 512
# A small model keeps every gate well under a second on a shared CPU.
SMALL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}
BATCH, SEQ = 4, 64


def _prepare(out: Path, vocab: int | None, **kw) -> Path:
    prepare([CORPUS], out, vocab_size=vocab, workers=1, progress=False, val_fraction=0.1, **kw)
    return out


@pytest.fixture(scope="session")
def gate_data(tmp_path_factory) -> Path:
    """A healthy data folder: 1024-piece BPE, ~38k training and ~5k validation tokens."""
    return built_once(tmp_path_factory, "gates", lambda root: _prepare(root / "data", VOCAB))


@pytest.fixture(scope="session")
def byte_data(tmp_path_factory) -> Path:
    """The same corpus through an English-only BPE: every Bangla character falls back to its 3 UTF-8
    bytes (the byte-level trap), with the tokenizer gates skipped at prepare time."""
    def build(root: Path) -> Path:
        english = [normalize(s) for f in sorted(CORPUS.glob("en_*.txt"))
                   for s in f.read_text(encoding="utf-8").splitlines() if s.strip()]
        train_tokenizer(english, BYTE_VOCAB, num_threads=1).save(root / "en.model")
        return _prepare(root / "bytes", None, tokenizer=root / "en.model",
                        skip_gates=["tokenizer.fertility", "tokenizer.balance"])

    return built_once(tmp_path_factory, "gates-bytes", build)


def variant(data: Path, dest: Path, *, val_from_train: bool = False, bad_token: int | None = None,
            drop_report: bool = False) -> Path:
    """A copy of `data` with one planted data defect."""
    shutil.copytree(data, dest)
    train_shard = dest / "train" / "shard_00000.bin"
    tokens = np.array(read_shard(train_shard))
    tok = Tokenizer.load(dest / "tokenizer.model")
    meta_vocab, sha = tok.vocab_size, tok.sha256
    if val_from_train:  # the validation split is a slice of the training text (split bug)
        write_shard(dest / "val" / "shard_00000.bin", tokens[5000:10000], meta_vocab, sha)
    if bad_token is not None:  # one id past the vocabulary (tokenized with another tokenizer)
        tokens[20000] = bad_token
        write_shard(train_shard, tokens, meta_vocab, sha)
    if drop_report:
        (dest / "report.json").unlink()
    return dest


def train_cfg(data: Path, out: Path | None = None, **over) -> TrainConfig:
    kw = dict(data=str(data), out=str(out or data.parent / "run"), preset="tiny", max_steps=10, batch_size=BATCH,
              seq_len=SEQ, device="cpu", eval_batches=4, model=dict(SMALL))
    kw.update(over)
    return TrainConfig(**kw).validate()


def make_ctx(data: Path, *, plant=None, loader=None, optimizer=None, cfg: TrainConfig | None = None,
             seed: int = 0) -> PreflightContext:
    """PreflightContext as the Trainer builds it (single process, CPU); `plant(model)` injects a defect,
    `loader(train_loader)` / `optimizer(factory)` wrap the data loader / optimizer factory."""
    cfg = cfg or train_cfg(data)
    d = D.Dist()
    device = torch.device("cpu")
    batches = pretraining_data(cfg, d)
    if loader is not None:
        batches.train = loader(batches.train)
    mcfg = cfg.model_config(batches.tokenizer.vocab_size)
    torch.manual_seed(seed)
    raw = Transformer(mcfg)
    if plant is not None:
        plant(raw)
    factory = lambda m: make_optimizer(m, cfg, device)  # noqa: E731
    if optimizer is not None:
        factory = optimizer(factory)
    return PreflightContext(model=raw, raw_model=raw, optimizer_factory=factory, batches=batches, cfg=cfg,
                            model_cfg=mcfg, device=device, autocast=autocast_for(cfg, device), dist=d,
                            flops_per_token=flops_per_token(mcfg, cfg.seq_len), peak_flops=None)

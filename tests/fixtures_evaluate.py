"""Fixtures for tests/test_evaluate.py, built only on what ships in the repo (nothing skips for data).

The trained model is conftest's `tiny_run`: the `tiny` preset (vocab 2048, ~2 M parameters) trained
300 steps by the real train.py on training/assets/corpus. It is evaluated on text it never saw,
training/assets/eval/heldout_bn.txt, and on the original multiple-choice sets beside it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ASSETS, CORPUS

from training.checkpoint.checkpoint_io import load_model
from training.model.decoder import ModelConfig, Transformer
from training.text.normalization import normalize
from training.text.tokenizer import Tokenizer, train_tokenizer

EVAL_ASSETS = ASSETS / "eval"
HELDOUT = EVAL_ASSETS / "heldout_bn.txt"
MC_BN = EVAL_ASSETS / "prodip_mc_bn.jsonl"
MC_EN = EVAL_ASSETS / "prodip_mc_en.jsonl"


def corpus_lines() -> list[str]:
    """Bangla and English lines shipped in the repo."""
    lines: list[str] = []
    for f in sorted(CORPUS.glob("*.txt")):
        lines += [normalize(s) for s in f.read_text(encoding="utf-8").splitlines() if s.strip()]
    return lines


def heldout_lines() -> list[str]:
    return [normalize(s) for s in HELDOUT.read_text(encoding="utf-8").splitlines() if s.strip()]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread: on a shared 2-core machine, 2 threads under contention run ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def corpus_tokenizer() -> Tokenizer:
    """A small (400-piece) tokenizer for the tests that need real tokens but no trained model."""
    return train_tokenizer(corpus_lines(), 400, num_threads=1)


@dataclass
class TrainedRun:
    run_dir: Path  # shared by the session: read it, never write into it (see `run_copy`)
    cfg: ModelConfig
    tokenizer: Tokenizer
    model: Transformer
    step: int


@pytest.fixture(scope="session")
def trained(tiny_run: Path) -> TrainedRun:
    model, ck = load_model(tiny_run)
    return TrainedRun(tiny_run, ck.config, ck.tokenizer, model.eval(), int(ck.state["step"]))


@pytest.fixture
def run_copy(tiny_run: Path, tmp_path: Path) -> Path:
    """A private copy of the trained run, for tests that write RUN/eval and RUN/export/README.md."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))

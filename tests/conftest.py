"""Shared test setup: offline mode, the ../shared/data location, and small CPU budgets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def shared_path(*parts: str) -> Path:
    """A path under ../shared/data, or skip the test (with a message) when it is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared data not available: {p} (see ../shared/data/README.md)")
    return p


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return shared_path()


# --------------------------------------------------------------------------- shared tiny artifacts
BN_TRAIN_FILES = (  # a few MB of real Bangla prose and verse from ../shared/data/bn/train
    "majantali_bnarchive/RabindranathTagore_Prose_Lipika.md",
    "majantali_bnarchive/SukumarRay_Prose_PaglaDashu.md",
    "majantali_bnarchive/AbanindranathTagore_Prose_BuroAngla.md",
)


@pytest.fixture(scope="session")
def bn_data(tmp_path_factory) -> Path:
    """A prepared data folder (vocab 2048) over real Bangla text; skipped without ../shared/data."""
    from training.prepare import prepare

    inputs = [shared_path("bn", "train", f) for f in BN_TRAIN_FILES]
    out = tmp_path_factory.mktemp("bn") / "data"
    prepare(inputs, out, vocab_size=2048, progress=False, workers=1, fertility_floor=1.5)
    return out


def run_train(*args: str, check: bool = True):
    """`python training/train.py ARGS` in a subprocess, as a user runs it."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(REPO / "training" / "train.py"), *args], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="session")
def tiny_run(bn_data, tmp_path_factory) -> Path:
    """A `tiny` run trained 300 steps on real Bangla: enough that top-1 agreement means something."""
    out = tmp_path_factory.mktemp("run") / "tiny"
    run_train("--preset", "tiny", "--data", str(bn_data), "--out", str(out), "--max-steps", "300",
              "--batch-size", "8", "--seq-len", "128", "--lr", "3e-3", "--warmup-steps", "20",
              "--eval-every", "100", "--save-every", "300", "--log-every", "100")
    return out

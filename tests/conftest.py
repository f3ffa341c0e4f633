"""Shared test setup: offline mode, fixtures built from what ships in training/assets, and the
../shared/data location for opt-in breadth.

Every fixture here builds on training/assets only, so a fresh clone runs every test. Tests that read
../shared/data are opt-in breadth, each beside a test of the same behaviour on training/assets: they
skip with an "opt-in:" message when it is absent, and fail instead when PRODIP_SHARED_DATA=1 (.ci/run
sets it: CI has ../shared). Under CI=true any skip that is not an "opt-in:" skip fails the run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TATOEBA = ("bn", "dev", "tatoeba_bn.txt")  # 5,120 modern Bangla lines under SHARED_DATA: opt-in breadth


ASSETS = REPO / "training" / "assets"
CORPUS = ASSETS / "corpus"
CHAT_SET = ASSETS / "chat" / "prodip_chat_bn.jsonl"
ORTHOGRAPHY = ASSETS / "text" / "orthography_bn.txt"  # not normalized on purpose: both nukta spellings, ZWJ/ZWNJ
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
OPT_IN = "opt-in:"  # the only skips CI accepts: say what to set to run the test


SHARED_ENV = "PRODIP_SHARED_DATA"  # "1": breadth tests must run (.ci/run sets it: CI has ../shared)


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (torchrun and servers pass it on and clean up), then SIGKILL after `timeout` s; reaped."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def shared_path(*parts: str) -> Path:
    """A path under ../shared/data for an opt-in breadth test. Present: the test runs. Absent: an
    "opt-in:" skip on a user's clone, but a failure when PRODIP_SHARED_DATA=1 says it must be there
    (as in CI, which always has ../shared beside the clone)."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        msg = f"shared data not available: {p} (see ../shared/data/README.md)"
        if os.environ.get(SHARED_ENV) == "1":
            pytest.fail(f"{SHARED_ENV}=1: {msg}")
        pytest.skip(f"{OPT_IN} breadth test on ../shared/data; {msg}")
    return p


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skip fails, unless it is a named opt-in (a GPU, PRODIP_TEST_COMPILE, ...)."""
    outcome = yield
    rep = outcome.get_result()
    if IN_CI and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if OPT_IN not in reason:
            rep.outcome = "failed"
            rep.longrepr = f"CI=true forbids this skip (only '{OPT_IN} ...' skips may pass): {reason}"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return shared_path()


# --------------------------------------------------------------------------- shared tiny artifacts
@pytest.fixture(scope="session")
def bn_data(tmp_path_factory) -> Path:
    """A prepared data folder (vocab 2048) over the corpus that ships in training/assets."""
    from training.prepare import prepare

    out = tmp_path_factory.mktemp("bn") / "data"
    prepare([CORPUS], out, vocab_size=2048, progress=False, workers=1, fertility_floor=1.5)
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
    """A `tiny` run trained 300 steps on the shipped corpus: the one shared trained model of the suite,
    enough that top-1 agreement means something."""
    out = tmp_path_factory.mktemp("run") / "tiny"
    run_train("--preset", "tiny", "--data", str(bn_data), "--out", str(out), "--max-steps", "300",
              "--batch-size", "8", "--seq-len", "128", "--lr", "3e-3", "--warmup-steps", "20",
              "--eval-every", "100", "--save-every", "300", "--log-every", "100")
    return out

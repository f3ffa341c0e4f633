"""torchrun on CPU (gloo, 2 processes): DDP equals a single process with the doubled batch, FSDP2
likewise where gloo supports it, and kill-and-resume under DDP continues the same curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_train

from training import checkpoint as ckpt
from training.data import TokenStream, WindowLoader

COMMON = ["--preset", "tiny", "--seq-len", "64", "--max-steps", "8", "--eval-every", "4", "--save-every", "100",
          "--log-every", "1000", "--lr", "3e-3", "--warmup-steps", "2", "--device", "cpu"]


def torchrun(*args: str, nproc: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
           str(REPO / "training" / "train.py"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-4000:]}")
    return p


def steps(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]


def assert_same_curve(a: list[dict], b: list[dict], tol: float = 2e-5) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= tol * max(1.0, abs(x["loss"])), (x["step"], x["loss"], y["loss"])
        if "val_loss" in x:
            assert abs(x["val_loss"] - y["val_loss"]) <= tol * max(1.0, abs(x["val_loss"]))


@pytest.fixture(scope="module")
def single(bn_data: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    run_train(*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "8")
    return out


def test_ddp_matches_single_process_with_double_batch(bn_data: Path, single: Path, tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    torchrun(*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "4")
    assert json.loads((out / "config.json").read_text())["train"]["batch_size"] == 4
    assert_same_curve(steps(single), steps(out))
    # the DDP checkpoint is an ordinary one: the single-process reader loads it
    w = ckpt.load(out).weights
    ws = ckpt.load(single).weights
    assert max((w[k] - ws[k]).abs().max().item() for k in w) < 1e-4


def test_ddp_kill_and_resume_continues_the_same_curve(bn_data: Path, single: Path, tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    torchrun(*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "4", "--stop-at", "4")
    assert ckpt.latest(out).name == ckpt.step_dir_name(4)
    p = torchrun(*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "4")
    assert "resumed from" in p.stdout
    assert_same_curve(steps(single), steps(out))


def test_fsdp2_matches_single_process(bn_data: Path, single: Path, tmp_path: Path) -> None:
    out = tmp_path / "fsdp"
    p = torchrun(*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "4", "--fsdp", check=False)
    if p.returncode != 0 and ("gloo" in p.stderr.lower() and "not supported" in p.stderr.lower()):
        pytest.skip("FSDP2 collectives are not supported by this torch's gloo backend on CPU")
    assert p.returncode == 0, p.stderr[-4000:]
    assert_same_curve(steps(single), steps(out), tol=1e-4)
    assert ckpt.load(out).config.n_layers == 2


def test_sharded_windows_cover_each_window_once_per_epoch(bn_data: Path) -> None:
    stream = TokenStream(bn_data, "train")
    world, b = 2, 3
    loaders = [WindowLoader(stream, 64, seed=5, rank=r, world_size=world) for r in range(world)]
    n = loaders[0].n_windows
    seen = []
    for _ in range(n // (world * b)):
        for ld in loaders:
            start = ld.consumed
            ld.next_batch(b)
            seen += [ld.window_index(start + i * world + ld.rank) for i in range(b)]
    assert len(seen) == len(set(seen))  # no overlap between ranks, no repeats within the epoch
    assert len(seen) == (n // (world * b)) * world * b  # no gaps: a full prefix of the permutation

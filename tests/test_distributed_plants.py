"""The runtime gates under torchrun (2 CPU processes, gloo), with a defect planted in ONE rank only.

A step's loss and gradient norm are judged after they are reduced over the ranks, so every rank
reaches the same verdict: a rank that skipped an update its peers applied would leave DDP's
replicas silently different (nothing compares them afterwards). Rank 0 writes log.jsonl, and here it
is the healthy rank: it can record the skip only if the verdict was shared.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from conftest import REPO
from safetensors.numpy import load_file
from test_distributed import COMMON, torchrun


def _events(run: Path, name: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r.get("event") == name]


def _final_weights_finite(run: Path) -> bool:
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    return all(np.isfinite(t).all() for t in load_file(newest / "model.safetensors").values())


def test_a_gradient_nan_on_one_rank_skips_the_step_on_every_rank_deferred(bn_data: Path, tmp_path: Path) -> None:
    """--fused-optimizer on: the update is skipped on the device without a host read (the deferred
    path); rank 1's NaN gradient reaches rank 0 through DDP's all-reduce and both skip step 3."""
    out = tmp_path / "run"
    p = torchrun(REPO / "tests" / "gates_runner.py", "nan_grad_at:3@1", *COMMON, "--data", str(bn_data),
                 "--out", str(out), "--batch-size", "2", "--fused-optimizer", "on", "--on-nonfinite", "skip",
                 "--grad-flow-every", "0")
    assert [e["step"] for e in _events(out, "nonfinite")] == [3], p.stdout[-2000:]
    steps = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "event" not in r]
    assert steps and all(np.isfinite(r["loss"]) for r in steps if r["step"] != 3)
    assert _final_weights_finite(out)


def test_a_loss_spike_on_one_rank_is_skipped_by_every_rank(bn_data: Path, tmp_path: Path) -> None:
    """Rank 1's loss x10 at step 13 (rank 0's is normal): the reduced loss spikes, rank 0 logs the skip."""
    out = tmp_path / "run"
    spiky = ["--max-steps", "14", "--spike-window", "20", "--spike-zscore", "6"]  # z-scores from step 11 on
    p = torchrun(REPO / "tests" / "gates_runner.py", "spike_at:13@1", *COMMON, *spiky, "--data", str(bn_data),
                 "--out", str(out), "--batch-size", "2", "--on-spike", "skip")
    assert [e["step"] for e in _events(out, "loss_spike_skipped")] == [13], p.stdout[-2000:]
    assert _final_weights_finite(out)

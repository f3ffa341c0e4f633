"""--log-to tensorboard: the step log's numbers in RUN/tensorboard/, read back with TensorBoard's own
EventAccumulator; a resumed run continues the curves exactly; bad values are one clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from training.runfiles import layout
from training.runfiles.schema import SchemaError
from training.telemetry.step_metrics import StepLog
from training.telemetry.tracking import TENSORBOARD_DIR, open_tracker


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run / TENSORBOARD_DIR))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def rec(i: int, loss: float, **extra) -> dict:
    return {"step": i, "loss": loss, "lr": 1e-3 * i, "grad_norm": 0.5, "mfu": None, "tokens": 64 * i, **extra}


def test_every_number_at_its_step(tmp_path: Path) -> None:
    log = StepLog(tmp_path / layout.LOG, log_to="tensorboard")
    for i in range(1, 4):
        log.write(rec(i, 5.0 - i))
    log.write(rec(4, 1.5, val_loss=2.25, val_bpb=0.75))
    log.write({"event": "loss_spike_skipped", "step": 5, "loss": 9.0, "loss_spike_z": 7.5})
    log.close()
    s = scalars(tmp_path)
    assert s["train/loss"] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.5)]
    assert [st for st, _ in s["train/lr"]] == [1, 2, 3, 4] and s["train/lr"][2][1] == pytest.approx(3e-3)
    assert s["train/tokens"][-1] == (4, 256.0)
    assert s["val/val_loss"] == [(4, 2.25)] and s["val/val_bpb"] == [(4, 0.75)]
    assert s["event/loss_spike_skipped/loss_spike_z"] == [(5, 7.5)]
    assert "train/mfu" not in s  # None (CPU): nothing claimed
    assert "train/step" not in s


def test_a_resumed_run_continues_the_curves(tmp_path: Path) -> None:
    """The first segment logged steps 1-5 but its checkpoint is step 3: the resumed segment's
    steps 4-6 replace what was logged past the checkpoint, as log.jsonl's truncate_after does."""
    first = StepLog(tmp_path / layout.LOG, log_to="tensorboard")
    for i in range(1, 6):
        first.write(rec(i, 10.0 + i))
    first.close()
    resumed = StepLog(tmp_path / layout.LOG, log_to="tensorboard")
    resumed.truncate_after(3)
    for i in range(4, 7):
        resumed.write(rec(i, 20.0 + i))
    resumed.close()
    assert scalars(tmp_path)["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]


def test_off_by_default_and_on_other_ranks(tmp_path: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    log = StepLog(tmp_path / "a" / layout.LOG)
    log.write(rec(1, 1.0))
    log.close()
    assert not (tmp_path / "a" / TENSORBOARD_DIR).exists()
    log = StepLog(tmp_path / "b" / layout.LOG, enabled=False, log_to="tensorboard")  # rank != 0
    log.write(rec(1, 1.0))
    log.close()
    assert not list((tmp_path / "b").iterdir())


def test_an_unknown_tracker_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="tensorboard"):  # the nearest name suggested
        StepLog(tmp_path / layout.LOG, log_to="tensorbord")
    assert not list(tmp_path.iterdir())
    assert open_tracker("", tmp_path) is None


def test_train_py_logs_to_tensorboard(bn_data: Path, tmp_path: Path) -> None:
    """The real wiring: train.py --log-to tensorboard, read back; curves.png drawn beside it."""
    out = tmp_path / "run"
    run_train("--preset", "tiny", "--data", str(bn_data), "--out", str(out), "--max-steps", "4", "--eval-every", "2",
              "--batch-size", "2", "--seq-len", "64", "--log-every", "1000", "--log-to", "tensorboard")
    s = scalars(out)
    assert [st for st, _ in s["train/loss"]] == [1, 2, 3, 4]
    assert [st for st, _ in s["val/val_loss"]] == [2, 4]
    log = [json.loads(x) for x in (out / layout.LOG).read_text().splitlines()]
    assert [v for _, v in s["train/loss"]] == pytest.approx([r["loss"] for r in log if "loss" in r])
    assert (out / layout.CURVES).is_file()


def test_without_the_package_one_clear_error(tmp_path: Path) -> None:
    """A machine without tensorboard (simulated by a package that fails to import, first on the path)."""
    shim = tmp_path / "shim" / "tensorboard"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("No module named tensorboard")\n')
    code = ("from pathlib import Path; from training.telemetry.step_metrics import StepLog\n"
            f"StepLog(Path({str(tmp_path / 'run.jsonl')!r}), log_to='tensorboard')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": f"{shim.parent}{os.pathsep}{REPO}"})
    assert p.returncode != 0
    assert "ValueError: --log-to tensorboard needs the tensorboard package: pip install tensorboard" in p.stderr
    assert not (tmp_path / "run.jsonl").exists()

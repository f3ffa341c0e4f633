"""training/loop/runtime_checks.py in-process (issue #46 item 3, mutation target `checks`): the runtime gates'
verdict on one step's read values, as docs/gates.md ("Runtime gates") states it:

- a non-finite loss or gradient norm stops the run before the optimizer step, RUN_DIR/nonfinite.json
  naming the step, the loss, the norm, the first parameter with a non-finite gradient and the data
  position; `--on-nonfinite skip` skips such a batch instead, at most `--max-nonfinite-skips` times;
- a loss spike (z above `--spike-zscore` over `--spike-window`) prints a warning, and `--on-spike skip`
  also drops that batch's update (logged as `loss_spike_skipped`);
- gradient flow again every `--grad-flow-every` steps, from the step's own gradients.

The training runs that reach this module are subprocesses (test_gates.py, test_hot_path.py), which a
mutation run cannot see; these call RuntimeChecks on stand-in steps (no model, no training).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from training import distributed as D
from training import gates
from training.config_sections import ChecksSection
from training.loop.runtime_checks import RuntimeChecks
from training.loop.step import StepResult
from training.run_context import RunContext
from training.train_config import TrainConfig

POSITION = {"epoch": 0, "index": 7}


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.said: list[str] = []


def params(grads: dict[str, torch.Tensor | None]) -> list[tuple[str, torch.nn.Parameter]]:
    out = []
    for name, g in grads.items():
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = g
        out.append((name, p))
    return out


def healthy() -> list[tuple[str, torch.nn.Parameter]]:
    return params({"a": torch.ones(2), "b": torch.ones(2)})


def make(tmp_path: Path, trainable=None, d: D.Dist | None = None, **cfg) -> tuple[RuntimeChecks, Recorder]:
    rec = Recorder()
    cfg.setdefault("grad_flow_every", 0)
    ctx = RunContext(d or D.Dist(), torch.device("cpu"), tmp_path, log=rec.events.append, say=rec.said.append)
    checks = RuntimeChecks(ChecksSection.of(TrainConfig(**cfg)), ctx, healthy() if trainable is None else trainable)
    return checks, rec


def step(n: int, loss: float = 1.0, norm: float = 1.0, **kw) -> StepResult:
    return StepResult(step=n, lr=1e-3, loss=loss, grad_norm=norm, position=POSITION, **kw)


# --------------------------------------------------------------------------- gradient flow's cadence
def test_gradient_flow_runs_every_n_steps_and_never_at_zero(tmp_path):
    checks, _ = make(tmp_path, grad_flow_every=3)
    assert [checks.should_check_flow(s) for s in range(1, 8)] == [False, False, True, False, False, True, False]
    off, _ = make(tmp_path, grad_flow_every=0)  # 0 switches the check off (and is no modulus)
    assert [off.should_check_flow(s) for s in range(0, 5)] == [False] * 5


def test_a_dead_gradient_on_the_cadence_stops_the_run_naming_the_step(tmp_path):
    dead = params({"a": torch.ones(2), "b": None})
    checks, _ = make(tmp_path, dead, grad_flow_every=2)
    assert checks.judge(step(1)) is True  # off the cadence: not checked
    with pytest.raises(gates.GateError, match=r"^step 2: runtime gradient-flow check failed: no gradient: b"):
        checks.judge(step(2))
    ok, _ = make(tmp_path, healthy(), grad_flow_every=2)
    assert ok.judge(step(2)) is True


def test_a_deferred_step_is_not_flow_checked(tmp_path):
    # a deferred step's values are read after later steps ran: its gradients are gone, so the flow check
    # (which needs the step's own gradients) does not run on it
    checks, _ = make(tmp_path, params({"a": None}), grad_flow_every=1)
    assert checks.judge(step(1, deferred=True)) is True


# --------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize(("loss", "norm"), [(math.nan, 1.0), (1.0, math.inf), (-math.inf, math.nan)])
def test_a_nonfinite_loss_or_norm_stops_before_the_update(tmp_path, loss, norm):
    nan_grad = params({"a": torch.ones(2), "b": torch.tensor([1.0, math.nan]), "c": torch.tensor([math.inf, 0.0])})
    checks, rec = make(tmp_path, nan_grad)
    with pytest.raises(gates.GateError) as e:
        checks.judge(step(4, loss, norm))
    msg = str(e.value)
    assert msg.startswith("step 4: non-finite loss or gradient (") and str(tmp_path / "nonfinite.json") in msg
    diag = json.loads((tmp_path / "nonfinite.json").read_text())
    assert diag["step"] == 4 and diag["first_nonfinite_param"] == "b" and diag["data_position"] == POSITION
    assert diag["loss"] == repr(loss) and diag["grad_norm"] == repr(norm)
    assert rec.events == [{"event": "nonfinite", **diag}]
    assert checks.nonfinite_skips == 1


def test_skip_allows_exactly_max_nonfinite_skips(tmp_path):
    checks, rec = make(tmp_path, on_nonfinite="skip", max_nonfinite_skips=2)
    assert checks.judge(step(1, math.nan)) is False
    assert checks.judge(step(2)) is True  # a finite step in between does not reset the count
    assert checks.judge(step(3, 1.0, math.nan)) is False
    assert [s for s in rec.said if "batch skipped" in s] == [
        s for s in rec.said if s.startswith("warning: step ")]
    assert "(1/2)" in rec.said[0] and rec.said[0].startswith("warning: step 1: non-finite")
    assert "(2/2)" in rec.said[1] and rec.said[1].startswith("warning: step 3: non-finite")
    with pytest.raises(gates.GateError, match="^step 5: non-finite"):
        checks.judge(step(5, math.inf))
    assert checks.nonfinite_skips == 3
    assert [e["step"] for e in rec.events] == [1, 3, 5]


def test_skip_with_no_skips_allowed_stops_at_once(tmp_path):
    checks, _ = make(tmp_path, on_nonfinite="skip", max_nonfinite_skips=0)
    with pytest.raises(gates.GateError):
        checks.judge(step(1, math.nan))


def test_stop_stops_even_with_skips_left(tmp_path):
    checks, _ = make(tmp_path, on_nonfinite="stop", max_nonfinite_skips=5)
    with pytest.raises(gates.GateError):
        checks.judge(step(1, math.nan))


class OtherRankBad(D.Dist):
    """A rank whose own values are finite while another rank's are not: `any` says so on every rank."""

    def any(self, flag: bool, device: torch.device) -> bool:
        return True


def test_another_ranks_nonfinite_step_is_skipped_here_too(tmp_path):
    checks, _ = make(tmp_path, d=OtherRankBad(), on_nonfinite="skip", max_nonfinite_skips=1)
    assert checks.judge(step(1)) is False
    # deferred: loss and norm are reduced over ranks already, so this rank's own values decide
    assert checks.judge(step(2, deferred=True)) is True


def test_a_deferred_step_names_the_parameter_the_device_found(tmp_path):
    # the deferred step's gradients are gone: the diagnostic takes the device's index among trainables
    checks, _ = make(tmp_path, params({"a": torch.ones(2), "b": torch.ones(2)}))
    with pytest.raises(gates.GateError):
        checks.judge(step(3, math.nan, deferred=True, first_bad=1))
    assert json.loads((tmp_path / "nonfinite.json").read_text())["first_nonfinite_param"] == "b"
    # not deferred: the gradients are scanned now, whatever first_bad says
    now, _ = make(tmp_path, params({"a": torch.tensor([math.nan, 0.0]), "b": torch.ones(2)}))
    with pytest.raises(gates.GateError):
        now.judge(step(3, math.nan, first_bad=1))
    assert json.loads((tmp_path / "nonfinite.json").read_text())["first_nonfinite_param"] == "a"


def test_only_the_main_rank_writes_the_diagnostic(tmp_path):
    checks, rec = make(tmp_path, d=D.Dist(rank=1), on_nonfinite="skip", max_nonfinite_skips=1)
    assert checks.judge(step(1, math.nan)) is False
    assert not (tmp_path / "nonfinite.json").exists() and rec.events == []
    assert checks.nonfinite_skips == 1  # counted on every rank: each stops at the same step


# --------------------------------------------------------------------------- loss spikes
def spiking(tmp_path: Path, on_spike: str) -> tuple[RuntimeChecks, Recorder]:
    checks, rec = make(tmp_path, on_spike=on_spike, spike_window=20, spike_zscore=6.0)
    for i in range(10):  # a history of 10 (max(10, window // 2)) losses 1.0, 1.1: mean 1.05, sd 0.05
        assert checks.judge(step(i + 1, 1.0 + 0.1 * (i % 2))) is True
    return checks, rec


def test_a_spike_warns_and_trains_on_by_default(tmp_path):
    checks, rec = spiking(tmp_path, "warn")
    r = step(11, 2.05)  # z = (2.05 - 1.05) / 0.05 = 20
    assert checks.judge(r) is True
    assert r.spike_z == pytest.approx(20.0)
    assert rec.said == ["warning: step 11: loss spike (z=20.0)"] and rec.events == []


def test_on_spike_skip_drops_the_batch_and_logs_it(tmp_path):
    checks, rec = spiking(tmp_path, "skip")
    r = step(11, 2.05)
    assert checks.judge(r) is False
    assert rec.events == [{"event": "loss_spike_skipped", "step": 11, "loss": 2.05, "loss_spike_z": r.spike_z}]
    assert r.spike_z == pytest.approx(20.0)
    assert len(rec.said) == 1 and rec.said[0].startswith("warning: step 11: loss spike (z=20.0)")
    assert "skipped" in rec.said[0] and "--on-spike skip" in rec.said[0]


def test_no_spike_no_warning(tmp_path):
    checks, rec = spiking(tmp_path, "skip")
    r = step(11, 1.1)  # z = 1: no spike
    assert checks.judge(r) is True and r.spike_z is None and rec.said == [] and rec.events == []


class DeviceSeen(D.Dist):
    """Records the device the cross-rank vote is taken on: NCCL needs the run's device, not the default."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list = []

    def any(self, flag: bool, device: torch.device) -> bool:
        self.devices.append(device)
        return flag


def test_the_vote_on_a_nonfinite_step_runs_on_the_runs_device(tmp_path):
    d = DeviceSeen()
    checks = RuntimeChecks(ChecksSection.default(grad_flow_every=0), RunContext(d, torch.device("meta"), tmp_path),
                           healthy())
    assert checks.judge(step(1)) is True
    assert d.devices == [torch.device("meta")]

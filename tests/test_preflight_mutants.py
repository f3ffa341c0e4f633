"""training/loop/preflight_runner.py in-process (issue #46 item 3, mutation target `preflight`): the pre-flight
gates' one verdict for every rank, and the resume logic docs/gates.md ("On resume") states:

    `gates.json` records the setting it was reached under (device, autocast dtype, world size,
    `--compile`, FSDP2 and its resharding, activation checkpointing, whether the optimizer is fused,
    the gates skipped). Resuming with the same setting runs no gate; resuming with another one prints
    what changed, runs every pre-flight gate again on the resumed model, and keeps the earlier reports
    under `previous` in the new `gates.json`. If one fails, the resume stops before any step.

test_gates.py checks this end to end through training subprocesses, which a mutation run cannot see;
these call Preflight on an untrained tiny model with a registry of stand-in gates (no training).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from training import distributed as D
from training import gates
from training.loop.preflight_runner import Preflight
from training.loop.step import ModelViews
from training.model.decoder import ModelConfig, Transformer
from training.run_context import RunContext
from training.telemetry.step_metrics import flops_per_token
from training.train_config import TrainConfig

TINY = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=16)
FP32 = {"device": "cpu", "world_size": 1, "dtype": "fp32", "compile": False, "fsdp": False,
        "activation_checkpointing": False, "fused_optimizer": False, "skipped_by_user": []}


class Folder:
    def __init__(self) -> None:
        self.saved: list[gates.GateReport] = []

    def save_failed_gates(self, report: gates.GateReport) -> None:
        self.saved.append(report)


class Ranks(D.Dist):
    """A rank among `world_size`, where the ranks in `bad` failed their gates and rank 0 broadcasts `zero`."""

    def __init__(self, rank: int = 0, world_size: int = 2, bad: tuple[int, ...] = (), zero: list[int] | None = None):
        super().__init__(rank=rank, world_size=world_size, group=True)
        self.bad, self.zero, self.sent, self.votes, self.devices = list(bad), zero, [], [], []

    def ranks_where(self, flag: bool, device: torch.device) -> list[int]:
        self.votes.append(flag)
        self.devices.append(device)
        return sorted({*self.bad, *([self.rank] if flag else [])})

    def broadcast_ints(self, values: list[int], device: torch.device) -> list[int]:
        self.sent.append(list(values))
        self.devices.append(device)
        return list(values) if self.is_main else list(self.zero)


def views(optimizer: torch.optim.Optimizer | None = None, autocast=contextlib.nullcontext) -> ModelViews:
    torch.manual_seed(0)
    model = Transformer(TINY)
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ModelViews(model=model, wrapped=model, forward_model=model, optimizer=opt, autocast=autocast,
                      device=torch.device("cpu"))


def registry(passed: bool = True, seen: list | None = None) -> dict:
    def gate(ctx: gates.PreflightContext) -> list[gates.GateResult]:
        if seen is not None:
            seen.append(ctx)
        return [gates.GateResult("stand_in", passed, value=1.0, detail="judged")]
    return {"stand_in": gate}


def preflight(d: D.Dist | None = None, passed: bool = True, seen: list | None = None, **cfg
              ) -> tuple[Preflight, Folder, list[str]]:
    said: list[str] = []
    folder = Folder()
    cfg.setdefault("seq_len", 8)
    ctx = RunContext(d or D.Dist(), say=said.append)
    return Preflight(TrainConfig(**cfg), ctx, folder, registry(passed, seen)), folder, said


# --------------------------------------------------------------------------- the setting a verdict holds for
def test_the_setting_of_an_fp32_cpu_run():
    p, _, _ = preflight()
    assert p.setting(views()) == FP32


def test_the_setting_names_each_switch():
    v = views()
    model = v.model
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    p, _, _ = preflight(d=D.Dist(world_size=4), compile=True, fsdp=True, fsdp_reshard_after_forward=False,
                        activation_checkpointing=True, skip_gates=["overfit_one_batch", "data.token_range"])
    bf16 = views(fused, autocast=lambda: torch.autocast(device_type="cpu", dtype=torch.bfloat16))
    assert p.setting(bf16) == {"device": "cpu", "world_size": 4, "dtype": "bfloat16", "compile": True,
                               "fsdp": "no-reshard", "activation_checkpointing": True, "fused_optimizer": True,
                               "skipped_by_user": ["data.token_range", "overfit_one_batch"]}
    resharding, _, _ = preflight(fsdp=True, fsdp_reshard_after_forward=True)
    assert resharding.setting(views())["fsdp"] is True


# --------------------------------------------------------------------------- one verdict for every rank
def test_a_passed_report_records_its_setting_and_the_gates_context():
    seen: list = []
    p, folder, said = preflight(seen=seen, skip_gates=[])
    v, data, factory = views(), object(), (lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    report = p.run(v, data, factory, peak_flops=123.0)
    assert report.passed and report.setting == FP32 and report.skipped_by_user == []
    assert [r.name for r in report.results] == ["stand_in"] and folder.saved == []
    assert said == [report.table(), report.summary()] and said[1] == "all 1 gates passed"
    (ctx,) = seen
    assert ctx.model is v.forward_model and ctx.raw_model is v.model and ctx.optimizer_factory is factory
    assert ctx.batches is data and ctx.cfg is p.cfg and ctx.model_cfg == TINY and ctx.device == v.device
    assert ctx.autocast is v.autocast and ctx.dist is p.dist and ctx.peak_flops == 123.0
    assert ctx.flops_per_token == flops_per_token(TINY, 8)


def test_a_failed_gate_is_saved_for_the_user_and_raised():
    p, folder, said = preflight(passed=False)
    with pytest.raises(gates.GateError) as e:
        p.run(views(), object(), lambda m: None, None)
    assert e.value.report is not None and not e.value.report.passed
    assert folder.saved == [e.value.report] and said == [e.value.report.table()]  # no summary of a pass


def test_a_gate_failed_on_another_rank_fails_this_one_too():
    p, folder, _ = preflight(d=Ranks(rank=0, bad=(1, 3), world_size=4))
    with pytest.raises(gates.GateError) as e:
        p.run(views(), object(), lambda m: None, None)
    r = e.value.report
    assert [x.name for x in r.failed] == ["all_ranks"] and folder.saved == [r]
    (all_ranks,) = r.failed
    assert all_ranks.passed is False and all_ranks.value == 2.0 and all_ranks.threshold == "0"
    assert all_ranks.detail == "pre-flight gates failed on rank(s) [1, 3]; see their errors"


def test_a_rank_that_failed_itself_reports_its_own_gate_only():
    d = Ranks(rank=1, bad=(0,))
    p, _, _ = preflight(d=d, passed=False)
    with pytest.raises(gates.GateError) as e:
        p.run(views(), object(), lambda m: None, None)
    assert [x.name for x in e.value.report.results] == ["stand_in"]
    assert d.votes == [True] and d.devices == [torch.device("cpu")]  # its vote: "failed here", on its device


def test_every_rank_passing_adds_no_result():
    d = Ranks(rank=1)
    p, _, _ = preflight(d=d)
    assert [x.name for x in p.run(views(), object(), lambda m: None, None).results] == ["stand_in"]
    assert d.votes == [False]


def test_a_gate_the_user_skips_is_recorded_as_skipped():
    said: list[str] = []
    p = Preflight(TrainConfig(seq_len=8, skip_gates=["gradient_flow"]), RunContext(say=said.append), Folder(),
                  {"gradient_flow": registry()["stand_in"]})
    report = p.run(views(), object(), lambda m: None, None)
    assert report.skipped_by_user == ["gradient_flow"] and [r.skipped for r in report.results] == [True]
    assert said[-1] == "all 0 gates passed (1 SKIPPED by user: gradient_flow)"


# --------------------------------------------------------------------------- resume: what changed
def saved(path: Path, setting: dict, previous: list | None = None) -> gates.GateReport:
    r = gates.GateReport([gates.GateResult("stand_in", True, value=1.0)], setting=setting, previous=previous or [])
    r.save(path / "gates.json")
    return r


def test_the_same_setting_changes_nothing(tmp_path):
    saved(tmp_path, FP32)
    d = Ranks(world_size=1)
    p, _, said = preflight(d=d)
    assert p.changed_since(tmp_path, views()) == {} and said == [] and d.sent == [[0]]
    assert d.devices == [torch.device("cpu")]  # the broadcast on the run's device


def test_each_changed_entry_is_then_and_now(tmp_path):
    saved(tmp_path, {**FP32, "compile": True, "world_size": 2, "gone": 1})
    d = Ranks(world_size=1)
    p, _, _ = preflight(d=d)
    assert p.changed_since(tmp_path, views()) == {"compile": [True, False], "world_size": [2, 1]}
    assert d.sent == [[1]]


def test_an_unreadable_report_runs_the_gates_again_with_a_warning(tmp_path):
    p, _, said = preflight()
    changed = p.changed_since(tmp_path, views())  # no gates.json at all
    assert changed == {k: [None, v] for k, v in FP32.items()}
    assert len(said) == 1 and said[0].startswith(f"warning: {tmp_path / 'gates.json'} unreadable (")
    assert said[0].endswith("); running the pre-flight gates again")
    (tmp_path / "gates.json").write_text("{not json")
    assert p.changed_since(tmp_path, views()) == changed  # layout.LayoutError: the same answer


def test_other_ranks_take_rank_0s_answer(tmp_path):
    saved(tmp_path, {**FP32, "compile": True})  # another rank never reads it
    changed, _, said = preflight(d=Ranks(rank=1, zero=[1]))
    assert changed.changed_since(tmp_path, views()) == {"on rank 0": [None, None]} and said == []
    same, _, _ = preflight(d=Ranks(rank=1, zero=[0]))
    assert same.changed_since(tmp_path, views()) == {}


# --------------------------------------------------------------------------- resume: the gates again
def test_a_rerun_says_what_changed_and_keeps_the_earlier_reports(tmp_path):
    first = {"prodip_gates": 1, "passed": True}  # an earlier report the saved one already kept
    old = saved(tmp_path, {**FP32, "compile": True}, previous=[first])
    seen: list = []
    p, _, said = preflight(seen=seen)
    data, factory = object(), (lambda m: None)
    report = p.rerun(tmp_path, views(), data, factory, 9.5, 7, {"compile": [True, False], "dtype": ["bf16", "fp32"]})
    (ctx,) = seen  # the gates again, on the resumed run's own data, optimizer and peak
    assert ctx.batches is data and ctx.optimizer_factory is factory and ctx.peak_flops == 9.5
    assert said[0] == ("resumed at step 7 with another setting (compile True -> False, dtype 'bf16' -> 'fp32'): "
                       "running the pre-flight gates again")
    assert report.passed and report.setting == {**FP32, "resumed_at_step": 7}
    assert report.previous == [first, {**old.to_dict(), "previous": []}]
    assert json.loads(json.dumps(report.to_dict()))["previous"][1]["setting"]["compile"] is True


def test_a_rerun_over_an_unreadable_report_keeps_nothing(tmp_path):
    (tmp_path / "gates.json").write_text("[]")
    p, _, _ = preflight()
    report = p.rerun(tmp_path, views(), object(), lambda m: None, None, 3, {"compile": [None, False]})
    assert report.previous == [] and report.setting["resumed_at_step"] == 3


def test_a_failed_rerun_stops_the_resume(tmp_path):
    saved(tmp_path, FP32)
    p, _, _ = preflight(passed=False)
    with pytest.raises(gates.GateError):
        p.rerun(tmp_path, views(), object(), lambda m: None, None, 3, {"compile": [True, False]})


def test_another_rank_reruns_quietly(tmp_path):
    saved(tmp_path, FP32, previous=[{"x": 1}])
    p, _, said = preflight(d=Ranks(rank=1))
    report = p.rerun(tmp_path, views(), object(), lambda m: None, None, 3, {"on rank 0": [None, None]})
    assert [s for s in said if s.startswith("resumed")] == [] and report.previous == []
    assert "resumed_at_step" not in report.setting  # rank 0 writes gates.json

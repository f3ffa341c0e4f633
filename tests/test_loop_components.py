"""training.loop's components, each built alone from its constructor arguments (no Trainer): real
tensors, a real tiny Transformer and tokenizer, real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures_gates import SMALL, train_cfg

from training import distributed as D
from training.config_sections import CheckpointSection, ChecksSection, MetricsSection, StepSection
from training.data.loaders import Prefetcher, pretraining_data
from training.loop.checkpointer import Checkpointer
from training.loop.early_stopping import EarlyStopping
from training.loop.rank_agreement import TrainError, agreed
from training.loop.run_folder import RunFolder
from training.loop.step import StepResult, TrainStep, build_views, to_device
from training.loop.step_reads import StepReads
from training.model.decoder import Transformer, preset
from training.run_context import RunContext
from training.runfiles import layout
from training.telemetry.metrics_logger import EventLog, MetricsLogger
from training.text.tokenizer import Tokenizer

pytest_plugins = ("fixtures_gates",)  # gate_data
CPU = torch.device("cpu")
MODEL_CFG = preset("tiny", vocab_size=300, **SMALL)


# ------------------------------------------------------------------------------------ RunFolder
def test_run_folder_decides_ours_from_its_marker_never_from_file_names(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / layout.LOG).write_text("my own log\n")  # a user's files named like prodip's
    (out / layout.TOKENIZER).write_bytes(b"mine")
    with pytest.raises(TrainError, match="not a prodip run folder"):
        RunFolder(RunContext(out=out), force=False).check(MODEL_CFG)
    RunFolder(RunContext(out=out), force=True).check(MODEL_CFG)  # --force: the user said so
    RunFolder(RunContext(out=tmp_path / "new"), force=False).check(MODEL_CFG)  # not there yet: fine
    ours = RunFolder(RunContext(out=tmp_path / "ours"), force=False)
    ours.mark()
    (ours.out / layout.GATES).write_text("{}")  # what a failed start leaves behind
    ours.check(MODEL_CFG)
    assert not ours.holds_run and not ours.start_over


def test_run_folder_commit_writes_the_marker_and_run_json_and_refuses_another_model(gate_data, tmp_path) -> None:
    tok = Tokenizer.load(gate_data / layout.TOKENIZER)
    folder = RunFolder(RunContext(out=tmp_path / "run"), force=False)
    folder.check(MODEL_CFG)
    folder.commit(model_cfg=MODEL_CFG, train={"seed": 1}, tokenizer=tok)
    names = {p.name for p in folder.out.iterdir()}
    assert names == {layout.RUN_MARKER, layout.TOKENIZER, layout.RUN_CONFIG}
    run = layout.read_run_config(folder.out)
    assert run["kind"] == "pretrain" and run["model"] == MODEL_CFG.to_dict() and run["train"] == {"seed": 1}
    other = preset("tiny", vocab_size=300, **{**SMALL, "n_layers": 3})
    again = RunFolder(RunContext(out=folder.out), force=False)
    with pytest.raises(TrainError, match="another model config"):
        again.check(other)
    forced = RunFolder(RunContext(out=folder.out), force=True)
    forced.check(other)
    assert forced.holds_run and forced.start_over


# ------------------------------------------------------------------------------------- ranks
def test_agreed_returns_the_result_or_raises_the_ranks_own_error() -> None:
    assert agreed(D.Dist(), CPU, "adding", lambda: 1 + 1) == 2

    def fail() -> None:
        raise TrainError("the folder is not ours")

    with pytest.raises(TrainError, match="not ours"):
        agreed(D.Dist(), CPU, "reading", fail)


# -------------------------------------------------------------------------------- EarlyStopping
def test_early_stopping_counts_evaluations_without_a_new_best_and_round_trips_its_state(tmp_path: Path) -> None:
    logged, said = [], []
    ctx = RunContext(out=tmp_path, log=logged.append, say=said.append)
    es = EarlyStopping(2, ctx)
    assert es.track(10, 3.0) and not es.should_stop()
    assert not es.track(20, 3.5) and not es.should_stop()
    assert es.track(30, 2.5) and es.keep() == {30}  # a new best resets the count
    assert not es.track(40, 2.6) and not es.track(50, 2.7) and es.should_stop()
    again = EarlyStopping(2, ctx)
    again.load_state_dict(es.state_dict())
    assert again.best == {"val_loss": 2.5, "step": 30, "evals_since": 2} and again.should_stop()
    again.load_state_dict({})  # a checkpoint from before early stopping: the fresh state stays
    assert again.best["step"] == 30
    rec = es.stop(50)
    assert rec["best_step"] == 30 and rec["best_checkpoint"] is None  # no checkpoints in this folder
    assert json.loads((tmp_path / layout.EARLY_STOP).read_text()) == rec and logged == [rec]
    assert EarlyStopping(0, ctx).keep() == set()


# ----------------------------------------------------------------------------------- StepReads
def _result(step: int, loss: float, deferred: bool) -> StepResult:
    r = StepResult(step, 1e-3, torch.tensor(loss), torch.tensor(1.0), {})
    r.deferred = deferred
    return r


def test_step_reads_read_once_for_every_pending_step_judge_in_order_and_drop_what_the_checks_drop() -> None:
    judged, written = [], []

    def judge(r: StepResult) -> bool:
        judged.append((r.step, r.loss))
        return r.loss == r.loss  # a NaN is dropped

    cfg = ChecksSection.of(train_cfg(Path("unused"), grad_flow_every=0))
    reads = StepReads(cfg, deferred=True, judge=judge, record=MetricsLogger.record, write=written.append)
    assert not reads.should_read_now(1)  # deferred: no read until something needs the values
    for step, loss in ((1, 2.0), (2, float("nan")), (3, 1.5)):
        reads.add(_result(step, loss, deferred=True))
    current = reads.read(3)
    assert [s for s, _ in judged] == [1, 2, 3]
    assert [r["step"] for r in written] == [1]  # step 2 dropped; step 3 is returned, not yet written
    assert current["step"] == 3 and current["loss"] == 1.5
    reads.write_current(reads.current)
    assert [r["step"] for r in written] == [1, 3] and reads.current is None
    per_step = StepReads(cfg, deferred=False, judge=judge, record=MetricsLogger.record, write=written.append)
    assert per_step.should_read_now(1)


# ---------------------------------------------------------------------------- MetricsLogger
def test_metrics_logger_writes_queued_events_after_the_log_is_cut_to_the_resumed_step(tmp_path: Path) -> None:
    (tmp_path / layout.LOG).write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    ctx = RunContext(out=tmp_path, log=EventLog())
    m = MetricsLogger(MetricsSection.of(train_cfg(Path("unused"), out=tmp_path)), ctx)
    m.load_state_dict({"tokens": 640, "elapsed_s": 12.5})
    ctx.log({"event": "reset_optimizer", "step": 2})  # met at resume, before the log is open
    m.open(2)
    ctx.log({"event": "checkpoint", "step": 3})  # once it is open: written at once
    m.close()
    recs = [json.loads(x) for x in (tmp_path / layout.LOG).read_text().splitlines()]
    assert recs == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}, {"event": "reset_optimizer", "step": 2},
                    {"event": "checkpoint", "step": 3}]
    assert m.state_dict() == {"tokens": 640, "elapsed_s": 12.5}


# ------------------------------------------------------------------- TrainStep, Checkpointer
def test_the_train_step_and_a_checkpoint_round_trip_restore_the_same_next_step(gate_data: Path, tmp_path) -> None:
    """Save after one step, load into a fresh model: the second step is bit-identical. The batches come
    through the Trainer's Prefetcher (one drawn ahead): the checkpoint holds the position of those handed out."""
    cfg = train_cfg(gate_data, out=tmp_path / "run", save_every=5, max_steps=4)
    d = D.Dist()

    def build() -> tuple[TrainStep, object, Checkpointer]:
        torch.manual_seed(0)
        data = pretraining_data(cfg, d)
        section = StepSection.of(cfg)
        views = build_views(Transformer(cfg.model_config(data.tokenizer.vocab_size)), section, d, CPU)
        ctx = RunContext(d, CPU, cfg.out)
        batches = Prefetcher(data.train, lambda b: to_device(b, CPU))
        parts = (("data", batches, "data position"), (None, MetricsLogger(MetricsSection.of(cfg), ctx), "token count"))
        cp = Checkpointer(CheckpointSection.of(cfg), ctx, parts=parts)
        return TrainStep(views, section, d), (data, batches), cp

    step, (data, batches), cp = build()
    assert step.total_steps == 4 and step.tokens_per_step == cfg.batch_size * cfg.seq_len
    assert cp.should_save(5, last=False, stopping=False, new_best=False)
    assert not cp.should_save(3, last=False, stopping=False, new_best=False)
    assert cp.should_save(3, last=True, stopping=False, new_best=False)
    first = step.timed(1, batches)
    cp.save(1, step.views, data.tokenizer)
    cp.close()
    second = step.timed(2, batches).item()
    weights = {k: v.clone() for k, v in step.views.model.state_dict().items()}

    step2, (data2, batches2), cp2 = build()
    assert cp2.find_latest(data2.tokenizer.sha256, step2.total_steps) is not None
    assert cp2.resume(cp2.find_latest(data2.tokenizer.sha256, step2.total_steps), step2.views) == 1
    assert step2.timed(2, batches2).item() == second and torch.isfinite(first)
    assert all(torch.equal(v, step2.views.model.state_dict()[k]) for k, v in weights.items())
    with pytest.raises(TrainError, match="--max-steps 4 is below step 1"):  # a budget of 0 steps: below it
        cp2.find_latest(data2.tokenizer.sha256, 0)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_each_checkpoint_logs_its_stall_write_time_and_bytes(gate_data, tmp_path, mode):
    """#27 item 7: one `checkpoint` event in log.jsonl per save, its bytes those of the files on disk."""
    import gates_runner

    run = tmp_path / "run"
    model = sum((["--set", f"{k}={v}"] for k, v in SMALL.items()), [])
    sync = ["--no-async-checkpoints"] if mode == "sync" else []
    assert gates_runner.run("none", [
        "--preset", "tiny", "--data", str(gate_data), "--out", str(run), "--max-steps", "5", "--batch-size", "2",
        "--seq-len", "32", "--device", "cpu", "--eval-every", "0", "--save-every", "2", *model, *sync]) == 0
    events = [r for r in map(json.loads, (run / layout.LOG).read_text().splitlines()) if r.get("event") == "checkpoint"]
    on_disk = {int(c.name.split("_")[1]): sum(f.stat().st_size for f in c.iterdir())
               for c in (run / layout.CHECKPOINTS).iterdir()}
    assert sorted(on_disk) == [2, 4, 5] and [e["step"] for e in events] == [2, 4, 5]
    for e in events:
        assert e["bytes"] == on_disk[e["step"]] > 0, (e, on_disk)
        assert e["stall_ms"] > 0 and e["write_s"] > 0 and e["wait_ms"] >= 0 and e["async"] == (mode == "async"), e

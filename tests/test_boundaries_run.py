"""The training side's boundaries: nothing written until everything is checked, resume exact or
refused, one guarded reader for every JSON file, and early stopping on validation.

Every CLI case runs in-process through `training.train.main(argv)` on a shrunk `tiny` model; each
failing case must exit 2 with exactly one `error:` line naming the file or flag, no traceback, and
leave the existing run folder (and data folder) byte-identical, by sha256 over the whole tree.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_reliability import train_argv, tree_digest
from safetensors.torch import load_file, save_file

from training import gates
from training.checkpoint import checkpoint_io as ckpt
from training.gates import GateReport, GateResult
from training.runfiles import layout
from training.train import main as train_main

STEPS = 4  # the base run: checkpoints at 2 and 4


def _argv(data: Path, out: Path, *extra: str, steps: int = STEPS, save_every: int = 2) -> list[str]:
    return train_argv(data, out, *extra, steps=steps, save_every=save_every)[2:]  # without `python train.py`


def _train(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = train_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def base_run(bn_data, tmp_path_factory) -> Path:
    """A 4-step run (checkpoints at 2 and 4) written by train.py's main. Copy before changing it."""
    out = tmp_path_factory.mktemp("boundaries") / "run"
    assert train_main(_argv(bn_data, out)) == 0
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _newest(run: Path) -> Path:
    return ckpt.latest(run)


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _drop_rng(run: Path) -> None:
    f = _newest(run) / ckpt.OPTIM_FILE
    t = {k: v for k, v in load_file(str(f)).items() if not k.startswith(ckpt.RNG_PREFIX)}
    save_file(t, str(f))


def _drop_moment(run: Path) -> None:
    f = _newest(run) / ckpt.OPTIM_FILE
    t = load_file(str(f))
    del t[next(k for k in t if k.endswith("/exp_avg_sq"))]
    save_file(t, str(f))


def _truncate(path: Path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


# (damage to a copy of the run, extra flags, what the one error line must say)
RESUME_CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...], str]] = {
    "state.json garbage": (lambda r: (_newest(r) / ckpt.STATE_FILE).write_text("garbage"), (),
                           "state.json: checkpoint state is not valid JSON"),
    "state.json truncated": (lambda r: _truncate(_newest(r) / ckpt.STATE_FILE), (), "state.json: checkpoint state is "
                             "not valid JSON"),
    "state.json missing": (lambda r: (_newest(r) / ckpt.STATE_FILE).unlink(), (), "state.json: checkpoint state not "
                           "found"),
    "state.json a list": (lambda r: (_newest(r) / ckpt.STATE_FILE).write_text("[1, 2]"), (), "must hold a JSON object"),
    "state.json other version": (lambda r: _edit_json(_newest(r) / ckpt.STATE_FILE, lambda d: d.update(
        prodip_format=99)), (), "format version 99"),
    "state.json step a string": (lambda r: _edit_json(_newest(r) / ckpt.STATE_FILE, lambda d: d.update(step="4")), (),
                                 "'step' must be an integer"),
    "data position missing": (lambda r: _edit_json(_newest(r) / ckpt.STATE_FILE, lambda d: d.pop("data")), (),
                              "state.json: checkpoint state lacks 'data'"),
    "data position damaged": (lambda r: _edit_json(_newest(r) / ckpt.STATE_FILE, lambda d: d["data"].pop("consumed")),
                              (), "state.json: damaged data position"),
    "model.safetensors missing": (lambda r: (_newest(r) / ckpt.MODEL_FILE).unlink(), (), "model.safetensors (the model "
                                  "weights) not found"),
    "model.safetensors missing, --reset-optimizer": (lambda r: (_newest(r) / ckpt.MODEL_FILE).unlink(),
                                                     ("--reset-optimizer",), "model.safetensors (the model weights)"),
    "model.safetensors truncated": (lambda r: _truncate(_newest(r) / ckpt.MODEL_FILE), ("--reset-optimizer",),
                                    "model.safetensors: truncated or corrupted"),
    "optim.safetensors missing": (lambda r: (_newest(r) / ckpt.OPTIM_FILE).unlink(), (),
                                  "optim.safetensors: optimizer state not found; --reset-optimizer"),
    "optim.safetensors truncated": (lambda r: _truncate(_newest(r) / ckpt.OPTIM_FILE), (),
                                    "optim.safetensors: truncated or corrupted"),
    "RNG state missing": (_drop_rng, (), "optim.safetensors: holds no RNG state"),
    "an optimizer moment missing": (_drop_moment, (), "no optimizer state"),
    "optimizer param groups missing": (lambda r: _edit_json(_newest(r) / ckpt.STATE_FILE, lambda d: d.pop(
        "optimizer_param_groups")), (), "no optimizer_param_groups"),
    "config.json garbage": (lambda r: (_newest(r) / ckpt.CONFIG_FILE).write_text("{"), (), "config.json: model config"),
    "run.json garbage": (lambda r: (r / layout.RUN_CONFIG).write_text("{ not json"), (), "run.json: run config is not "
                         "valid JSON"),
    "run.json without its format": (lambda r: _edit_json(r / layout.RUN_CONFIG, lambda d: d.pop("prodip_run")), (),
                                    "run.json: not a prodip run config"),
    "run.json model not an object": (lambda r: _edit_json(r / layout.RUN_CONFIG, lambda d: d.update(model=3)), (),
                                     "'model' must be an object"),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_a_damaged_resume_source_is_refused_and_changes_nothing(case, base_run, bn_data, tmp_path, capsys):
    damage, extra, needle = RESUME_CASES[case]
    run = _copy(base_run, tmp_path / "run")
    damage(run)
    before, data_before = tree_digest(run), tree_digest(bn_data)
    rc, _, err = _train(capsys, _argv(bn_data, run, *extra, steps=6))
    assert rc == 2, err
    line = _one_error_line(err)
    assert needle in line, line
    assert tree_digest(run) == before and tree_digest(bn_data) == data_before


def _data_copy(bn_data: Path, tmp: Path, damage: Callable[[Path], None]) -> Path:
    data = _copy(bn_data, tmp / "data")
    damage(data)
    return data


# (damage to a copy of the data folder or None, extra flags, needle)
START_CASES: dict[str, tuple[Callable[[Path], None] | None, tuple[str, ...], str]] = {
    "meta.json truncated": (lambda d: _truncate(d / layout.DATA_META), (), "meta.json: data meta is not valid JSON"),
    "meta.json empty": (lambda d: (d / layout.DATA_META).write_text(""), (), "meta.json: empty data meta"),
    "meta.json another version": (lambda d: _edit_json(d / layout.DATA_META, lambda m: m.update(prodip_data=7)), (),
                                  "meta.json: data meta format version 7"),
    "meta.json without splits": (lambda d: _edit_json(d / layout.DATA_META, lambda m: m.pop("splits")), (),
                                 "meta.json: data meta lacks 'splits'"),
    "report.json garbage": (lambda d: (d / layout.DATA_REPORT).write_bytes(b"\x00\xff\xfe"), (), "report.json"),
    "report.json fertility not an object": (lambda d: _edit_json(d / layout.DATA_REPORT, lambda r: r.update(
        fertility="high")), (), "report.json: data report: 'fertility' must be an object"),
    "seq_len beyond the context": (None, ("--seq-len", "128"), "max_seq_len"),
    "early stop without validation": (None, ("--early-stop-patience", "2"), "--early-stop-patience 2 needs validation"),
}


@pytest.mark.parametrize("case", list(START_CASES))
@pytest.mark.parametrize("where", ["existing run", "new folder"])
def test_a_start_that_fails_writes_nothing(case, where, base_run, bn_data, tmp_path, capsys):
    damage, extra, needle = START_CASES[case]
    data = _data_copy(bn_data, tmp_path, damage) if damage else bn_data
    run = _copy(base_run, tmp_path / "run") if where == "existing run" else tmp_path / "new"
    # a fresh start (--force, another model) for the new folder; the same run's resume for the existing one
    flags = ("--set", "n_layers=2", "--force") if where == "new folder" else ()
    before, data_before = tree_digest(run), tree_digest(data)
    rc, _, err = _train(capsys, _argv(data, run, *flags, *extra, steps=6))
    assert rc == 2, err
    line = _one_error_line(err)
    assert needle in line, line
    assert tree_digest(run) == before and tree_digest(data) == data_before
    assert run.exists() == (where == "existing run"), "a failed start created the run folder"


def test_other_run_without_force_and_force_that_fails_later_change_nothing(base_run, bn_data, tmp_path, capsys):
    run = _copy(base_run, tmp_path / "run")
    before = tree_digest(run)
    rc, _, err = _train(capsys, _argv(bn_data, run, "--set", "n_layers=2"))
    assert rc == 2 and "another model config" in _one_error_line(err)
    assert tree_digest(run) == before
    # --force over it, but a failing pre-flight gate (an LR that cannot overfit one batch): the old run's
    # checkpoints, log and gates.json stay; the failed report is printed, not written over the run's
    rc, out, err = _train(capsys, _argv(bn_data, run, "--set", "n_layers=2", "--force", "--lr", "1e4"))
    assert rc == 2 and "pre-flight gates failed" in err.splitlines()[0], err
    assert "| FAIL |" in out
    assert tree_digest(run) == before


def test_a_failed_start_never_blocks_the_correct_command(bn_data, tmp_path, capsys):
    run = tmp_path / "run"
    rc, _, err = _train(capsys, _argv(bn_data, run, "--set", "n_layers=abc"))
    assert rc == 2 and "n_layers" in _one_error_line(err) and not run.exists()
    # what a failed pre-flight gate leaves in a new folder: the marker prodip writes first, and its
    # report for the user to read
    run.mkdir()
    (run / layout.RUN_MARKER).write_text("a prodip run folder\n", encoding="utf-8")
    GateReport([GateResult("overfit_one_batch", False, 0.1, ">= 50%", "loss did not fall")]).save(run / layout.GATES)
    rc, _, err = _train(capsys, _argv(bn_data, run, "--set", "n_layers=2"))  # the corrected command
    assert rc == 0, err
    assert gates.require_passed(run).passed and layout.read_run_config(run)["model"]["n_layers"] == 2
    # a folder holding anything else is still not ours
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("years of work")
    (other / layout.GATES).write_text("{}")
    before = tree_digest(other)
    rc, _, err = _train(capsys, _argv(bn_data, other))
    assert rc == 2 and "not a prodip run folder (it holds 'notes.txt'" in _one_error_line(err)
    assert tree_digest(other) == before
    # nor is one holding only files named like ours ([boundaries-2]: decided from the marker, not names)
    named = tmp_path / "named-like-ours"
    named.mkdir()
    (named / layout.LOG).write_text('{"mine": true}\n', encoding="utf-8")
    (named / layout.TOKENIZER).write_bytes(b"my own tokenizer")
    before = tree_digest(named)
    rc, _, err = _train(capsys, _argv(bn_data, named))
    assert rc == 2 and "not a prodip run folder" in _one_error_line(err)
    assert tree_digest(named) == before


def test_reset_optimizer_resumes_and_is_recorded(base_run, bn_data, tmp_path, capsys):
    run = _copy(base_run, tmp_path / "run")
    (_newest(run) / ckpt.OPTIM_FILE).unlink()
    rc, out, err = _train(capsys, _argv(bn_data, run, "--reset-optimizer", steps=6))
    assert rc == 0, err
    assert "resumed from" in out and "(step 4," in out and "fresh optimizer moments" in out
    recs = [json.loads(x) for x in (run / layout.LOG).read_text().splitlines()]
    events = [r for r in recs if r.get("event") == "reset_optimizer"]
    assert len(events) == 1 and events[0]["step"] == 4 and not events[0]["rng_restored"]
    assert "optim.safetensors: optimizer state not found" in events[0]["reason"]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5, 6]
    # asked for on an intact checkpoint: a fresh optimizer, the RNG still restored, and said why
    run2 = _copy(base_run, tmp_path / "run2")
    rc, _, err = _train(capsys, _argv(bn_data, run2, "--reset-optimizer", steps=6))
    assert rc == 0, err
    ev = [json.loads(x) for x in (run2 / layout.LOG).read_text().splitlines() if "reset_optimizer" in x]
    assert ev == [{"event": "reset_optimizer", "step": 4, "reason": "requested (--reset-optimizer)",
                   "rng_restored": True}]


def test_a_checkpoint_that_lost_a_file_is_not_skipped_silently(base_run, bn_data, tmp_path, capsys):
    """An older complete checkpoint exists, but resuming from it would drop steps without saying so."""
    run = _copy(base_run, tmp_path / "run")
    (_newest(run) / ckpt.STATE_FILE).unlink()
    assert ckpt.latest(run).name == ckpt.step_dir_name(STEPS)
    with pytest.raises(ckpt.CheckpointError, match="state.json: checkpoint state not found"):
        ckpt.load(run)


# ------------------------------------------------------------------------------ the guarded reader
def test_read_json_names_the_file_and_what_is_wrong(tmp_path):
    f = tmp_path / "x.json"
    schema = {"step": int, "name": str}
    cases = [
        (None, "x.json: thing not found"),
        ("", "x.json: empty thing"),
        ('{"step": 1, "na', "x.json: thing is not valid JSON (truncated"),
        ("\x00\x01binary", "x.json: thing is not valid JSON"),
        ("[1]", "x.json: thing must hold a JSON object, not list"),
        ('{"v": 1, "name": "a"}', "x.json: thing lacks 'step'"),
        ('{"v": 1, "step": "3", "name": "a"}', "'step' must be an integer, not str"),
        ('{"v": 1, "step": true, "name": "a"}', "'step' must be an integer, not bool"),
        ('{"v": 2, "step": 3, "name": "a"}', "x.json: thing format version 2; this prodip reads version 1"),
        ('{"step": 3, "name": "a"}', "x.json: not a prodip thing (no 'v' format field)"),
    ]
    for text, needle in cases:
        f.unlink(missing_ok=True)
        if text is not None:
            f.write_text(text)
        with pytest.raises(layout.LayoutError) as e:
            layout.read_json(f, "thing", required=schema, version=("v", 1))
        assert needle in str(e.value) and str(f) in str(e.value), (text, str(e.value))
    f.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(layout.LayoutError, match="unreadable thing"):
        layout.read_json(f, "thing")
    f.write_text('{"v": 1, "step": 3, "name": "a", "extra": [1]}')
    assert layout.read_json(f, "thing", required=schema, version=("v", 1))["step"] == 3


@pytest.mark.parametrize("text,needle", [
    ("garbage", "gates.json: gate report is not valid JSON"),
    ('{"prodip_gates": 1, "passed": true, "results": [3]}', "results[0] must be an object"),
    ('{"prodip_gates": 1, "passed": true, "results": [{"passed": true}]}', "lacks 'name'"),
    ('{"prodip_gates": 1, "passed": true, "results": [{"name": "a", "passed": false}]}', "says passed=True"),
    ('{"prodip_gates": 1, "passed": true, "results": []}', "records no gates"),
    ('{"prodip_gates": 5, "passed": true, "results": []}', "format version 5"),
])
def test_a_garbage_gate_report_is_refused_naming_the_file(tmp_path, text, needle):
    (tmp_path / layout.GATES).write_text(text)
    with pytest.raises(gates.GateError) as e:
        gates.require_passed(tmp_path)
    assert needle in str(e.value) and str(tmp_path / layout.GATES) in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------- early stop
def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / layout.LOG).read_text().splitlines()]


def test_early_stop_keeps_the_best_checkpoint_as_the_newest(bn_data, tmp_path, capsys):
    """A learning rate far too high for the shrunk model: validation loss stops improving within a few
    evaluations. --keep-last 1 with saves between evaluations: the best must survive the pruning."""
    run = tmp_path / "run"
    argv = _argv(bn_data, run, "--lr", "0.3", "--schedule", "constant", "--eval-every", "2", "--eval-batches", "2",
                 "--early-stop-patience", "2", "--keep-last", "1", "--skip-gate", "overfit_one_batch", steps=60,
                 save_every=1)
    rc, out, err = _train(capsys, argv)
    assert rc == 0, err
    recs = _records(run)
    vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    stop = json.loads((run / layout.EARLY_STOP).read_text())
    best_step, best_val = min(vals, key=lambda sv: (sv[1], sv[0]))
    assert stop["best_step"] == best_step and stop["best_val_loss"] == best_val
    assert stop["step"] == vals[-1][0] < 60, "it did not stop early"
    assert [s for s, _ in vals if s > best_step] == [s for s, _ in vals][-2:]  # exactly `patience` evals after it
    assert [c.name for c in ckpt.list_checkpoints(run)] == [ckpt.step_dir_name(best_step)]
    assert ckpt.read_state(ckpt.latest(run))["early_stop"]["step"] == best_step
    assert [r for r in recs if r.get("event") == "early_stop"] == [stop]
    assert f"early stop at step {stop['step']}" in out
    # the same command again: nothing to do, nothing written
    before = tree_digest(run)
    rc, out, err = _train(capsys, argv)
    assert rc == 0 and "already stopped early" in out, err
    assert tree_digest(run) == before
    good = (run / layout.EARLY_STOP).read_text()
    (run / layout.EARLY_STOP).write_text(good[: len(good) // 2])  # a damaged record: named, nothing changed
    before = tree_digest(run)
    rc, _, err = _train(capsys, argv)
    assert rc == 2 and "early_stop.json: early-stop record is not valid JSON" in _one_error_line(err)
    assert tree_digest(run) == before
    (run / layout.EARLY_STOP).write_text(good)
    # early stopping switched off: it trains on from the best checkpoint, the log cut back to it
    rc, out, err = _train(capsys, [*argv, "--early-stop-patience", "0", "--max-steps", str(best_step + 2)])
    assert rc == 0, err
    assert f"(step {best_step}," in out and not (run / layout.EARLY_STOP).exists()
    assert [r["step"] for r in _records(run) if "loss" in r] == list(range(1, best_step + 3))

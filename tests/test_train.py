"""train.py end to end: loss falls on real Bangla, exact resume, and bad input is refused cleanly."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import run_train

from training.checkpoint import checkpoint_io as ckpt
from training.runfiles import layout

FAST = ["--preset", "tiny", "--batch-size", "4", "--grad-accum", "2", "--seq-len", "64", "--log-every", "1000"]


def losses(run: Path) -> list[tuple[int, float, float]]:
    recs = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r]


def test_loss_falls_on_real_bangla(tiny_run: Path) -> None:
    recs = [r for r in map(json.loads, (tiny_run / "log.jsonl").read_text().splitlines()) if "event" not in r]
    first = sum(r["loss"] for r in recs[:10]) / 10
    last = sum(r["loss"] for r in recs[-10:]) / 10
    assert last < first - 1.0, (first, last)  # from ~ln(2048)=7.6 to well below
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert vals[-1] < vals[0]
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "elapsed_s"} <= set(recs[-1])
    assert recs[-1]["mfu"] is None  # CPU: no MFU claimed
    gates = json.loads((tiny_run / "gates.json").read_text())
    assert gates["passed"]


def test_exact_resume_is_bit_identical(bn_data: Path, tmp_path: Path) -> None:
    n = 12
    common = [*FAST, "--data", str(bn_data), "--max-steps", str(2 * n), "--eval-every", "6", "--save-every", "100"]
    run_train(*common, "--out", str(tmp_path / "once"))
    run_train(*common, "--out", str(tmp_path / "twice"), "--stop-at", str(n))
    assert ckpt.latest(tmp_path / "twice").name == ckpt.step_dir_name(n)
    p = run_train(*common, "--out", str(tmp_path / "twice"))
    assert "resumed from" in p.stdout
    a, b = losses(tmp_path / "once"), losses(tmp_path / "twice")
    assert len(a) == len(b) == 2 * n
    assert a == b  # bit-identical floats, step by step
    # step records only: the stopped session wrote one more checkpoint, and its event (#27 item 7)
    va = [r.get("val_loss") for r in map(json.loads, (tmp_path / "once" / "log.jsonl").read_text().splitlines())
          if "event" not in r]
    vb = [r.get("val_loss") for r in map(json.loads, (tmp_path / "twice" / "log.jsonl").read_text().splitlines())
          if "event" not in r]
    assert va == vb
    wa = ckpt.load(tmp_path / "once").weights
    wb = ckpt.load(tmp_path / "twice").weights
    assert all((wa[k] == wb[k]).all() for k in wa)


def test_missing_data_dir_is_one_line_error(tmp_path: Path) -> None:
    p = run_train(*FAST, "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "run"), "--max-steps", "2", check=False)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and "not found" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists()


def test_other_model_config_in_run_dir_is_refused(bn_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_train(*FAST, "--data", str(bn_data), "--out", str(out), "--max-steps", "2")
    before = (out / "log.jsonl").read_bytes()
    p = run_train(*FAST, "--data", str(bn_data), "--out", str(out), "--max-steps", "4", "--set", "n_layers=3", check=False)
    assert p.returncode == 2 and "another model config" in p.stderr and "Traceback" not in p.stderr
    assert (out / "log.jsonl").read_bytes() == before  # nothing overwritten
    assert ckpt.latest(out).name == ckpt.step_dir_name(2)


def test_resume_with_data_of_another_tokenizer_is_refused(bn_data: Path, tmp_path: Path) -> None:
    from conftest import CORPUS

    from training.prepare import prepare

    other = tmp_path / "other"  # the shipped Bangla stories alone, at another vocabulary: another tokenizer
    prepare([CORPUS / "bn_stories.txt", CORPUS / "bn_news.txt"], other, vocab_size=2048, progress=False, workers=1,
            fertility_floor=1.0, skip_gates=["tokenizer.balance"])
    out = tmp_path / "run"
    run_train(*FAST, "--data", str(bn_data), "--out", str(out), "--max-steps", "2")
    p = run_train(*FAST, "--data", str(other), "--out", str(out), "--max-steps", "4", check=False)
    assert p.returncode == 2 and "another tokenizer" in p.stderr
    assert ckpt.latest(out).name == ckpt.step_dir_name(2)


def test_bad_config_values(bn_data: Path, tmp_path: Path) -> None:
    p = run_train(*FAST, "--data", str(bn_data), "--out", str(tmp_path / "r"), "--max-steps", "2", "--schedule", "zigzag",
                  check=False)
    assert p.returncode == 2 and "schedule" in p.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nbatch_sise = 3\n")
    p = run_train("--config", str(bad), "--data", str(bn_data), "--out", str(tmp_path / "r2"), check=False)
    assert p.returncode == 2 and "unknown keys" in p.stderr


def test_toml_config_and_cli_override(bn_data: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\npreset = "tiny"\nbatch_size = 2\nseq_len = 32\nmax_steps = 3\nschedule = "wsd"\n'
                   '[model]\nn_layers = 1\n')
    out = tmp_path / "run"
    run_train("--config", str(cfg), "--data", str(bn_data), "--out", str(out), "--max-steps", "2")
    conf = json.loads((out / layout.RUN_CONFIG).read_text())
    assert conf["model"]["n_layers"] == 1 and conf["train"]["max_steps"] == 2 and conf["train"]["schedule"] == "wsd"
    # the run's config is run.json; a checkpoint's config.json is the model config alone
    assert not (out / layout.LEGACY_RUN_CONFIG).exists()
    assert json.loads((ckpt.latest(out) / ckpt.CONFIG_FILE).read_text()) == conf["model"]


def test_a_run_folder_from_before_run_json_still_resumes(bn_data: Path, tmp_path: Path) -> None:
    """Runs written when the run config was RUN_DIR/config.json resume, and their config is still checked."""
    out = tmp_path / "old"
    args = [*FAST, "--data", str(bn_data), "--out", str(out), "--max-steps", "4", "--eval-every", "0"]
    run_train(*args, "--stop-at", "2")
    os.replace(out / layout.RUN_CONFIG, out / layout.LEGACY_RUN_CONFIG)  # as such a run folder looks
    p = run_train(*args, "--set", "n_layers=3", check=False)  # the legacy file is read: another model is refused
    assert p.returncode == 2 and "another model config" in p.stderr, p.stderr
    p = run_train(*args)
    assert "resumed from" in p.stdout and "(step 2," in p.stdout, p.stdout
    assert [s for s, _, _ in losses(out)] == [1, 2, 3, 4]
    assert layout.read_run_config(out)["train"]["max_steps"] == 4 and (out / layout.RUN_CONFIG).is_file()


def test_a_user_folder_with_files_named_like_ours_is_not_taken_for_a_failed_start(bn_data: Path, tmp_path: Path):
    """#28: "ours" comes from the marker prodip writes first, never from file names a user may have too."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / layout.LOG).write_text('{"my": "own log"}\n')
    (out / layout.TOKENIZER).write_bytes(b"my own tokenizer")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    p = run_train(*FAST, "--data", str(bn_data), "--out", str(out), "--max-steps", "2", check=False)
    assert p.returncode == 2 and "not a prodip run folder" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ")
    assert {q.name: q.read_bytes() for q in out.iterdir()} == before  # nothing written, nothing appended


def test_a_resume_that_would_not_be_exact_or_goes_backwards_is_refused(bn_data: Path, tmp_path: Path) -> None:
    """#28: another --seed reshuffles the data, and a --max-steps below the run's step would print "done"
    and rewrite run.json: both are refused with one line naming the flag, and nothing is rewritten."""
    out = tmp_path / "run"
    args = [*FAST, "--data", str(bn_data), "--out", str(out), "--eval-every", "0"]
    run_train(*args, "--max-steps", "3")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for extra, needle in ((["--max-steps", "4", "--seed", "7"], "--seed 1337"),
                          (["--max-steps", "2"], "--max-steps 2 is below step 3")):
        p = run_train(*args, *extra, check=False)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ")
        assert {q: q.read_bytes() for q in out.rglob("*") if q.is_file()} == before
    p = run_train(*args, "--max-steps", "4")  # the same settings and a larger budget still resume
    assert "resumed from" in p.stdout and [s for s, _, _ in losses(out)] == [1, 2, 3, 4]

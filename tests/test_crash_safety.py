"""Crash safety: SIGKILL at random moments (mid-checkpoint included) and a full disk never cost a run.

1. A tiny run is killed with SIGKILL at least 20 times (seeded random moments: during start-up,
   mid-step, right after a save, and while a checkpoint is being written), restarted with the same
   command each time until it finishes. Every restart must resume from the newest complete
   checkpoint, and the per-step losses and the final weights must equal an uninterrupted run's,
   bit for bit.
2. A save on a full disk (a small tmpfs, or a size-limited file where mounting is not permitted)
   ends with one clean `error:` line, and the previous checkpoints are byte-identical and loadable;
   after freeing space the same command resumes and finishes.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import time
import warnings
from collections import Counter
from pathlib import Path

import preloaded
import pytest
from fixtures_reliability import REPO, child_env, run_cli, train_argv, tree_digest
from safetensors.torch import load_file

from training.checkpoint import checkpoint_io as ckpt
from training.runfiles import layout

SEED = 20240607
STEPS = 40
KILLS = 20
END_GAME = STEPS - 6  # past this step only kills that cannot advance the run, so 20 kills always fit
POLL_S = 0.001
ATTEMPT_TIMEOUT_S = 240
MAX_ATTEMPTS = 60


def _log_records(run: Path, *, live: bool = True) -> list[dict]:
    """The step records of RUN/log.jsonl, parsed strictly: every complete line is one JSON object, and
    a line that is not fails the test. While a run may be writing (`live`), a last line without its
    newline is a write in flight, or one torn by a kill that the next resume drops; it is left out.
    Once the run is over (`live=False`) even that fails."""
    f = run / layout.LOG
    if not f.is_file():
        return []
    *lines, tail = f.read_text(encoding="utf-8").split("\n")  # tail: "" when the file ends with a newline
    assert live or not tail, f"{f}: a torn last line survived the run: {tail!r}"
    out = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise AssertionError(f"{f}:{n}: not a JSON record ({e.msg}): {line!r}") from None
        assert isinstance(rec, dict), f"{f}:{n}: not a JSON object: {line!r}"
        if "loss" in rec and "step" in rec:
            out.append(rec)
    return out


def _step_losses(run: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in _log_records(run, live=False)]


def test_log_records_are_parsed_strictly(tmp_path):
    """Control for the parser the kill test trusts: a garbage line fails it, a torn tail only once the run is over."""
    good = json.dumps({"step": 1, "loss": 7.0, "grad_norm": 1.0})
    (tmp_path / layout.LOG).write_text(f"{good}\n" + '{"step": 2, "lo')
    assert [r["step"] for r in _log_records(tmp_path)] == [1]
    with pytest.raises(AssertionError, match="torn last line"):
        _log_records(tmp_path, live=False)
    (tmp_path / layout.LOG).write_text(f"{good}\nnot json\n{good}\n")
    with pytest.raises(AssertionError, match=r"log.jsonl:2: not a JSON record"):
        _log_records(tmp_path)


def _latest_step(run: Path) -> int:
    c = ckpt.latest(run)
    return int(c.name[len(ckpt.STEP_PREFIX):]) if c else 0


def _own_tmp(run: Path, pid: int) -> list[Path]:
    root = run / "checkpoints"
    return list(root.glob(f"{ckpt.TMP_PREFIX}*-{pid}")) if root.is_dir() else []


def _wait(p: subprocess.Popen, cond, deadline: float) -> bool:
    """Poll `cond()` until true (-> True) or the process exits / the deadline passes (-> False)."""
    while time.monotonic() < deadline:
        if cond():
            return True
        if p.poll() is not None:
            return False
        time.sleep(POLL_S)
    raise AssertionError("training attempt hung")


KINDS = ("startup", "mid_step", "after_save", "mid_save", "mid_save")  # each round of five holds every kind


def _kill_at_random(p: subprocess.Popen, run: Path, rng: random.Random, base_step: int, stdout: Path,
                    kind: str, kills_left: int = 0) -> str | None:
    """Kill `p` at a random moment of the given kind; returns the kind, or None if it finished first."""
    deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
    # End game: only kills that cannot advance the run, once the steps left are few for the kills left
    # (a fast machine gets through many steps per attempt, so this cannot be a fixed step number).
    end_game = base_step >= END_GAME or STEPS - base_step <= kills_left + 4
    if end_game and kind not in ("startup", "mid_save"):
        kind = rng.choice(["startup", "mid_save"])
    if kind == "startup":  # imports, resume load, log truncation, pre-flight gates, the first step
        # a random moment, but never past this attempt's first step: on a fast machine a fixed delay
        # would let the run race ahead and finish before all KILLS have landed
        t_end = time.monotonic() + rng.uniform(0.0, 0.5 if end_game else 4.0)
        if not _wait(p, lambda: time.monotonic() >= t_end or len(_log_records(run)) > base_step, deadline):
            return None
    elif kind == "mid_step":
        first = f"step {base_step + 1}/{STEPS} "  # printed after this attempt's first step (the log is truncated by then)
        k = rng.randint(1, 2)
        if not _wait(p, lambda: first in stdout.read_text() and len(_log_records(run)) >= base_step + k, deadline):
            return None
        t_end = time.monotonic() + rng.uniform(0.0, 0.3)  # inside the next step, not several steps later
        if not _wait(p, lambda: time.monotonic() >= t_end or len(_log_records(run)) > base_step + k, deadline):
            return None
    elif kind == "after_save":  # between the rename and the pruning / next log line
        if not _wait(p, lambda: _latest_step(run) > base_step, deadline):
            return None
    else:  # while this process's hidden temporary checkpoint folder exists: mid-save
        nth = 1 if end_game else rng.randint(1, 2)
        seen: set[str] = set()

        def writing() -> bool:
            seen.update(t.name for t in _own_tmp(run, p.pid))
            return len(seen) >= nth and bool(_own_tmp(run, p.pid))

        if not _wait(p, writing, deadline):
            return None
        time.sleep(rng.uniform(0.0, 0.005))
    if p.poll() is not None:
        return None
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    if kind == "mid_save" and not _own_tmp(run, p.pid):
        kind = "mid_save_missed"  # the save finished between the check and the kill
    return kind


def test_sigkill_20_times_resumes_exactly(bn_data, tmp_path):
    ref, run = tmp_path / "uninterrupted", tmp_path / "killed"
    argv = train_argv(bn_data, run, steps=STEPS, save_every=1)
    ref_log = open(tmp_path / "ref.log", "w")  # noqa: SIM115
    reference = preloaded.popen(train_argv(bn_data, ref, steps=STEPS, save_every=1), cwd=REPO, env=child_env(),
                                 stdout=ref_log, stderr=subprocess.STDOUT)
    rng = random.Random(SEED)
    kinds: Counter[str] = Counter()
    stale_seen = 0
    try:
        for attempt in range(MAX_ATTEMPTS):
            base = _latest_step(run)
            if base:  # what the next attempt must resume from is complete and loadable
                ck = ckpt.load(run)
                assert ck.state["step"] == base
            stale_seen += bool(list((run / "checkpoints").glob(ckpt.TMP_PREFIX + "*"))) if run.exists() else 0
            with open(tmp_path / f"attempt-{attempt:02d}.log", "w") as log:
                p = preloaded.popen(argv, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
                if sum(kinds.values()) >= KILLS:
                    assert p.wait(timeout=ATTEMPT_TIMEOUT_S * 2) == 0, (tmp_path / f"attempt-{attempt:02d}.log").read_text()
                    break
                if attempt % len(KINDS) == 0:
                    order = rng.sample(KINDS, len(KINDS))
                kind = _kill_at_random(p, run, rng, base, tmp_path / f"attempt-{attempt:02d}.log",
                                       order[attempt % len(KINDS)], KILLS - sum(kinds.values()))
            out = (tmp_path / f"attempt-{attempt:02d}.log").read_text()
            if kind is None:  # finished before the kill landed: must have succeeded
                assert p.returncode == 0, out
                break
            kinds[kind] += 1
            assert "Traceback" not in out, out
            if base and (f"step {base + 1}/" in out or "resumed from" in out):  # it got as far as resuming
                assert f"resumed from {run / 'checkpoints' / ckpt.step_dir_name(base)} (step {base}," in out, out
    finally:
        if reference.poll() is None:
            reference.wait(timeout=ATTEMPT_TIMEOUT_S * 2)
        ref_log.close()
    assert reference.returncode == 0, (tmp_path / "ref.log").read_text()[-3000:]

    n_kills = sum(kinds.values())
    assert n_kills >= KILLS, f"only {n_kills} kills landed ({dict(kinds)})"
    assert kinds["mid_save"] >= 3 and kinds["startup"] >= 1, f"too few kills mid-save or at start-up ({dict(kinds)})"
    assert stale_seen >= 1, "no killed save ever left a temporary folder behind"

    got, want = _step_losses(run), _step_losses(ref)
    assert [s for s, _, _ in want] == list(range(1, STEPS + 1))
    assert [s for s, _, _ in got] == list(range(1, STEPS + 1)), "steps lost or repeated in log.jsonl"
    assert got == want, "per-step losses / grad norms differ from the uninterrupted run"
    a = load_file(str(ckpt.latest(run) / ckpt.MODEL_FILE))
    b = load_file(str(ckpt.latest(ref) / ckpt.MODEL_FILE))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "final weights differ"
    assert not list((run / "checkpoints").glob(ckpt.TMP_PREFIX + "*")), "stale temporary folders left behind"
    print(f"kills: {dict(kinds)}")


# ------------------------------------------------------------------------------------------- full disk
PAGE = 4096
SLACK_BYTES = 1 << 20  # room for the small files a resume rewrites, far less than one checkpoint
BALLAST_CHECKPOINTS = 3  # what "freeing space" frees: room for the two remaining saves and then some


def _mount_tmpfs(where: Path, size: int) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _limit_file_size(limit: int):
    def apply() -> None:  # in the child: writes past `limit` fail with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _assert_clean_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert any(n in lines[0] for n in needles), lines[0]


def test_full_disk_during_save_is_a_clean_error(rel_run, tmp_path):  # noqa: F811
    data = layout.read_run_config(rel_run)["train"]["data"]
    used = sum(-(-p.stat().st_size // PAGE) * PAGE for p in rel_run.rglob("*") if p.is_file())
    ballast = BALLAST_CHECKPOINTS * sum(p.stat().st_size for p in ckpt.latest(rel_run).iterdir())
    mnt = tmp_path / "small-disk"
    mounted = _mount_tmpfs(mnt, used + SLACK_BYTES + ballast + PAGE)
    try:
        run = mnt / "run"
        shutil.copytree(rel_run, run)
        if mounted:  # the rest of the disk is taken by someone else's file
            (mnt / "ballast.bin").write_bytes(bytes(ballast))
        before = tree_digest(run / "checkpoints")
        argv = train_argv(Path(data), run, steps=6, save_every=1)
        if mounted:
            r = run_cli(argv)
            _assert_clean_error(r, "No space left on device")
        else:  # no permission to mount: a size-limited file stands in for the full disk
            limit = (run / "checkpoints" / "step_0000004" / ckpt.MODEL_FILE).stat().st_size // 2
            r = run_cli(argv, preexec_fn=_limit_file_size(limit))
            _assert_clean_error(r, "File too large", "too large")
        assert "could not write checkpoint 5" in r.stderr and "intact" in r.stderr, r.stderr
        assert tree_digest(run / "checkpoints") == before, "a previous checkpoint changed"
        assert not list((run / "checkpoints").glob(ckpt.TMP_PREFIX + "*")), "the partial save was left behind"
        ck = ckpt.load(run)
        assert ck.state["step"] == 4 and ck.optimizer_and_rng()[0]

        # free space, run the same command again: it resumes from step 4 and finishes
        if mounted:
            (mnt / "ballast.bin").unlink()
        r = run_cli(argv)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout and "(step 4," in r.stdout, r.stdout
        assert [s for s, _, _ in _step_losses(run)] == list(range(1, 7))
        assert _latest_step(run) == 6
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
    if not mounted:
        warnings.warn("mount not permitted: the full disk was a size-limited file (RLIMIT_FSIZE), not a small tmpfs",
                      stacklevel=1)

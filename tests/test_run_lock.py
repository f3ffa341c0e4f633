"""One run per folder (#42 item 6): while a process trains into a run folder, a second train.py (a
fresh start or a resume) on the same --out is refused at once with one `error:` line naming the folder
and the pid holding it, and changes nothing there; the lock goes with its holder, however it ends.

The holder here is a flock taken in this process (flock conflicts between open file descriptions, in
one process as across processes) or a RunLock in a child, so no test trains for long.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fixtures_reliability import REPO, call_main, child_env, one_error, train_argv, tree_digest

LOCK = ".prodip_lock"  # the lock file's name, as docs/reliability.md gives it


def _hold(run: Path) -> int:
    """Hold the folder as docs/reliability.md says a run does: flock on its lock file, the pid inside. An open
    file description of its own: flock conflicts with the trainer's in this process as across processes."""
    fd = os.open(run / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid()}).encode())
    return fd


def test_a_second_trainer_is_refused_while_the_first_holds_the_folder(rel_run, bn_data, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    first = _hold(run)  # what the first train.py holds for its life
    try:
        before = tree_digest(run)
        line = one_error(*call_main("training.train", train_argv(bn_data, run, steps=6)[2:], capsys), str(run))
        assert f"pid {os.getpid()}" in line and "in use" in line, line
        assert tree_digest(run) == before  # the holder's lock file included: a refused run removes nothing
    finally:
        os.close(first)
    rc, out, err = call_main("training.train", train_argv(bn_data, run, steps=5)[2:], capsys)  # free again
    assert rc == 0 and "resumed from" in out, err[-2000:]
    assert not (run / LOCK).exists()  # a run that ends takes its lock file with it


def test_a_child_holding_the_lock_is_named_and_its_death_frees_the_folder(rel_run, tmp_path):
    from training.loop.run_lock import RunInUse, RunLock

    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    hold = textwrap.dedent(f"""
        import sys
        from training.loop.run_lock import RunLock
        RunLock({str(run)!r}).acquire()
        print("held", flush=True)
        sys.stdin.read()  # until the test closes stdin, or kills it
    """)
    child = subprocess.Popen([sys.executable, "-c", hold], cwd=REPO, env=child_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(RunInUse, match=rf"{run} is in use by another training run \(pid {child.pid}"):
            RunLock(run).acquire()
    finally:
        child.kill()  # SIGKILL: no clean-up runs; the kernel lets go of the lock
        child.wait()
    assert (run / LOCK).exists()  # left behind by the killed holder: harmless, the next run takes it
    after = RunLock(run)
    after.acquire()
    after.release()
    assert not (run / LOCK).exists()


def test_a_fresh_out_made_for_the_lock_is_removed_when_the_start_fails(tmp_path):
    from training.loop.run_lock import RunInUse, RunLock

    out = tmp_path / "a" / "b" / "run"
    lock = RunLock(out)
    lock.acquire()
    assert (out / LOCK).is_file()
    with pytest.raises(RunInUse, match=rf"{out} is in use"):
        RunLock(out).acquire()
    lock.release()
    assert not (tmp_path / "a").exists()  # nothing was written there: every folder made for the lock is gone
    again = RunLock(out)
    again.acquire()
    (out / "log.jsonl").write_text("{}\n")  # the run wrote into it: the folder stays, the lock file goes
    again.release()
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl"]


def test_a_refused_start_on_a_fresh_out_leaves_the_holders_folder(bn_data, tmp_path, capsys):
    out = tmp_path / "new"
    out.mkdir()
    holder = _hold(out)
    try:
        line = one_error(*call_main("training.train", train_argv(bn_data, out, steps=1)[2:], capsys), str(out))
        assert "in use" in line and f"pid {os.getpid()}" in line, line
        assert sorted(p.name for p in out.iterdir()) == [LOCK]
    finally:
        os.close(holder)

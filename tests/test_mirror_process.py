"""The mirror's upload child process (training/mirror/run_mirror.py, training/store/mirror_worker.py, issue #29).

A real moto S3 server (tests/fixtures_remote.py) and a real child process; train.py's own runs
through it are tests/test_remote.py (kill -9 mid-upload, SIGTERM, an outage, ...). Here, what only
the child adds: it runs at a lower CPU priority than the training process, and a child that dies in
the middle of an upload is said in one warning line, restarted, and the checkpoint it was uploading
and the next one are committed; close() then reports the newest one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import moto  # noqa: F401  (dev dependencies, as s3fs: absent, this module fails, never skips)
import s3fs  # noqa: F401
from fixtures_remote import bucket, committed_steps

from training import distributed as D
from training.config_sections import MirrorSection
from training.mirror.run_mirror import Mirror
from training.run_context import RunContext

WAIT_S = 60.0  # an upload of a few KB takes ~0.1-1 s here; generous for a loaded 2-core machine
POLL_S = 0.01
FILES = {"model.safetensors": 4096, "optim.safetensors": 8192, "state.json": 64}


def _checkpoint(cache: Path, step: int) -> None:
    d = cache / "checkpoints" / f"step_{step:07d}"
    d.mkdir(parents=True)
    for name, size in FILES.items():
        (d / name).write_bytes(os.urandom(size))


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S)


def test_a_child_killed_mid_upload_is_one_warning_and_the_uploads_go_on(s3_server, tmp_path, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    fs, root = s3_server.fs(), f"{bucket(s3_server, 'child')}/run"
    cache, said = tmp_path / "cache", []
    m = Mirror(MirrorSection.default(out=f"s3://{root}", cache=str(cache), keep_last=0),
               RunContext(D.Dist(), out=cache, say=said.append))
    m._checked = m.reached = True  # a fresh URL: nothing to check or pull (Mirror.prepare's job)
    m.start()
    child = m._proc
    assert os.getpriority(os.PRIO_PROCESS, child.pid) > os.getpriority(os.PRIO_PROCESS, 0)  # the loop wins the CPU

    s3_server.hold = "run/checkpoints/step_0000001/optim.safetensors"
    s3_server.held.clear()
    try:
        _checkpoint(cache, 1)
        m.checkpoint(1)
        _until(s3_server.held.is_set, "the upload of step 1")
        os.kill(child.pid, signal.SIGKILL)  # dies mid-upload: the server holds one of its files
        _until(lambda: m._proc is not child and m._proc is not None, "the restart")
    finally:
        s3_server.hold = ""
        s3_server.release.set()  # the held request fails: that file never lands from the dead child
    time.sleep(0.2)
    s3_server.release.clear()
    _checkpoint(cache, 2)
    m.checkpoint(2)
    assert m.close(allow_local_only=False) == ""
    assert committed_steps(fs, root) == [1, 2]  # step 1 handed over again to the new child, then step 2
    warnings = [s for s in said if s.startswith("warning:")]
    assert len(warnings) == 1 and "upload process" in warnings[0] and "restarted" in warnings[0], said
    assert said[-1] == f"mirrored to s3://{root} (newest committed checkpoint: step 2)", said
    assert child.poll() is not None and m._proc is None  # no process left behind

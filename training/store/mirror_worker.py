"""The mirror's upload work (training.mirror.run_mirror), and the child process it runs in.

`Uploader` does one checkpoint's upload as the mirror's docstring says (hard-link staging, the files,
the run files, the commit marker, remote keep-N; retries with a doubling back-off and one warning
line; older queued checkpoints superseded). It runs on a thread of its own: in the child process
`python -m training.store.mirror_worker` during a run (its interpreter lock and its CPU time, at a
lower priority, are not the training loop's), or in the training process itself for the synchronous
upload of training.mirror.node_caches and for the benchmark's thread peer.

The child's protocol, one JSON array a line: stdin gets `["init", {url, cache, keep_last, state}]`
first, then `["checkpoint", step, keep]`, `["run_files"]` and `["close", seconds]`; stdout carries
`["ready", true]` once the store's library is imported, `["say", line]`, `["state", Uploader.state()]`
after each attempt, and `["end", pending]` before it exits. It ignores SIGINT/SIGTERM (the training process decides when uploads end) and exits at once
when its stdin closes or the training process is gone, so a killed run leaves no upload behind.
The imports here stay light (no torch): the child starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from training.runfiles import layout
from training.store import remote_run as remote

STAGING = ".mirror"  # RUN_CACHE/.mirror/: hard-linked snapshots of what is being uploaded
QUEUE = 4  # checkpoints waiting at most: an older one waiting is superseded by a newer one
POLL_S = 0.02  # how often the uploader looks for the checkpoint folder the writer renames into place
BACKOFF_S = (0.5, 60.0)  # first retry delay, longest (PRODIP_MIRROR_BACKOFF_MAX_S overrides it)
NICE = 10  # the child's niceness increment: on a busy machine the training loop gets the CPU first
PARENT_POLL_S = 0.05  # how often the child checks that the training process is still there (a kill ends it)
READ_BYTES = 1 << 16

Report = Callable[[str, Any], None]


def env_float(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


class Refused(Exception):  # noqa: N818 (a refusal, raised inside the uploader)
    pass


def step_name(step: int) -> str:
    return f"{layout.STEP_PREFIX}{step:07d}"


class Uploader:
    """The queue and the upload work; `report("say", line)` and `report("state", state())` tell the mirror."""

    STATE = ("reached", "committed_step", "failing", "checked", "start_over", "refused")

    def __init__(self, url: str, cache: Path, keep_last: int, report: Report, *,
                 keep: Callable[[], Container[int]] = tuple, alive: Callable[[], bool] = lambda: True):
        self.url, self.cache, self.keep_last, self.report = url, cache, keep_last, report
        self.remote: remote.Remote | None = None
        self.keep = keep  # steps remote keep-N must not prune (early stopping's best)
        self.alive = alive  # the training process is there: else no new attempt
        self.reached = False  # the store answered at least once in this run's processes
        self.committed_step = 0  # the newest checkpoint committed remotely
        self.failing = False  # inside an outage: its warning is said once
        self.checked = False  # the store holds nothing but this run (Mirror.prepare(), or _verified())
        self.start_over = False  # --force over another run at the URL: its checkpoints go before the first upload
        self.refused = ""  # why nothing is uploaded (the store turned out to hold another run)
        self._queue: deque[int] = deque()
        self._files_due = False
        self._closing = False
        self._deadline = 0.0
        self._cv = threading.Condition()
        self._staging = False  # work() runs: a thread of its own stages each queued checkpoint at once
        self._staged: dict[int, bool] = {}  # step -> hard-linked (True), or gone before it could be (False)

    def state(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.STATE}

    def load(self, state: dict[str, Any]) -> None:
        for k in self.STATE:
            setattr(self, k, state[k])

    # ------------------------------------------------------------------------ hand-offs
    def checkpoint(self, step: int) -> None:
        with self._cv:
            if len(self._queue) >= QUEUE:
                self._queue.popleft()  # superseded: a newer checkpoint is on its way
            self._queue.append(step)
            self._cv.notify_all()

    def run_files(self) -> None:
        with self._cv:
            self._files_due = True
            self._cv.notify_all()

    def finish(self, seconds: float) -> None:
        """The end: the run files once more, then work() returns when done, or `seconds` from now."""
        with self._cv:
            self._deadline = time.monotonic() + seconds
            self._files_due = True
            self._closing = True
            self._cv.notify_all()

    def pending(self) -> bool:
        with self._cv:
            return bool(self._queue)

    # ------------------------------------------------------------------------- the work
    def work(self) -> None:
        """The uploads, in order, until finish(); the staging thread beside them."""
        self._staging = True
        threading.Thread(target=self._stage, name="mirror-stage", daemon=True).start()
        delay = BACKOFF_S[0]
        while True:
            with self._cv:
                while not (self._queue or self._files_due or self._closing):
                    self._cv.wait()
                if not (self._queue or self._files_due) or (self.refused and self._closing):
                    return
                if self.refused:  # the store holds another run: nothing more is uploaded
                    self._queue.clear()
                    self._files_due = False
                    continue
                step = self._queue[0] if self._queue else None
                if step is None:
                    self._files_due = False
            if not self.alive():  # a killed run's upload is not retried behind its back
                return
            done = self._attempt(step)
            self.report("state", self.state())
            if done:
                delay = BACKOFF_S[0]
                continue
            with self._cv:
                if step is None:
                    self._files_due = True
                elif len(self._queue) > 1 and self._queue[0] == step:  # superseded while the store was down
                    self._queue.popleft()
                    shutil.rmtree(self.cache / STAGING / step_name(step), ignore_errors=True)
                if self._closing and time.monotonic() > self._deadline:
                    return
                self._cv.wait(delay)
            delay = min(delay * 2, env_float("PRODIP_MIRROR_BACKOFF_MAX_S", BACKOFF_S[1]))

    def _attempt(self, step: int | None) -> bool:
        """One upload (checkpoint `step`, or the run files): True when done (or refused for good)."""
        try:
            if step is not None:
                self.upload_checkpoint(step)
            else:
                self.upload_run_files()
        except Refused as e:  # the store holds another run (seen once it answered): no upload at all
            self.refused = str(e)
            self.report("say", f"warning: {e}; nothing is uploaded, the run goes on in {self.cache}")
            return True
        except Exception as e:  # an outage, a full disk, a denied write: retried (the uploader never dies)
            if not self.failing:
                self.failing = True
                self.report("say", f"warning: uploading to {self.url} failed ({e}); training goes on locally in "
                                   f"{self.cache}, retrying with back-off")
            return False
        self.reached = True
        if self.failing:
            self.failing = False
            self.report("say", f"uploads to {self.url} resumed")
        with self._cv:
            if step is not None and self._queue and self._queue[0] == step:
                self._queue.popleft()
        return True

    def upload_checkpoint(self, step: int, prune: bool = True) -> bool:
        """Checkpoint `step`, then its marker; False when it was gone before it could be staged."""
        name = step_name(step)
        staged = self.cache / STAGING / name
        if self._staging:  # the staging thread's word on it
            with self._cv:
                while step not in self._staged and self.alive():
                    self._cv.wait(POLL_S)
                ok = self._staged.get(step, False)
            if not ok and not staged.is_dir():
                return False  # failed or pruned before it could be taken: a newer checkpoint supersedes it
        elif not staged.is_dir() and not self._snapshot(step, staged):
            return False
        r = self._verified()
        self.upload_run_files()  # log.jsonl holds this step's record: it is up before the marker is
        r.upload_checkpoint(staged, step)
        self.committed_step = max(self.committed_step, step)
        shutil.rmtree(staged, ignore_errors=True)
        if prune:
            self._prune()
        return True

    def _stage(self) -> None:
        """Each queued checkpoint hard-linked as soon as its folder is in place, while an upload may be
        running: local keep-N of a fast run may prune it soon after."""
        while self.alive():
            with self._cv:
                for s in [s for s in self._staged if s not in self._queue]:
                    del self._staged[s]  # uploaded, or superseded
                todo = [s for s in self._queue if s not in self._staged]
                if not todo:
                    if self._closing:
                        return
                    self._cv.wait()
                    continue
            step = todo[0]
            staged = self.cache / STAGING / step_name(step)
            ok = staged.is_dir() or self._snapshot(step, staged)
            with self._cv:
                self._staged[step] = ok
                self._cv.notify_all()

    def _snapshot(self, step: int, staged: Path) -> bool:
        """Hard links to the checkpoint's files once its folder is in place; False when it never will be."""
        folder = self.cache / layout.CHECKPOINTS / step_name(step)
        while not folder.is_dir():
            with self._cv:  # a newer save, or the end, means its write is over (the writer waited for it)
                over = self._closing or any(s > step for s in self._queue)
            if over and not folder.is_dir():
                return False  # its write failed, or keep-N pruned it already
            with self._cv:
                self._cv.wait(POLL_S)
        tmp = staged.with_name(f".tmp-{staged.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for f in folder.iterdir():
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        except FileNotFoundError:  # pruned by keep-N meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        os.replace(tmp, staged)
        return True

    def _verified(self) -> remote.Remote:
        """The store, once it holds nothing that is not this run: checked at start-up, or at the first
        answer of a store that was down then; a --force start-over removes the old run's checkpoints first."""
        r = self.remote = self.remote or remote.Remote(self.url)
        if not self.checked:
            names = r.names()
            theirs = r.read_json(layout.RUN_CONFIG, "run config") if layout.RUN_CONFIG in names else None
            mine = layout.read_run_config(self.cache) or {}
            if theirs is not None and theirs.get("model") != mine.get("model") and not self.start_over:
                raise Refused(f"{self.url} holds a run with another model config")
            if theirs is None and names and layout.RUN_MARKER not in names and not self.start_over:
                raise Refused(f"{self.url} is not empty and is not a prodip run (it holds {names[0]!r})")
            self.checked = True
        if self.start_over:
            r.remove(layout.CHECKPOINTS, recursive=True)
            r.remove(layout.LOG)
            r.remove(remote.EXPORT_COMMIT)  # the old run's written-back exports: marker first
            r.remove(layout.EXPORT, recursive=True)
            self.start_over = False
        return r

    def upload_run_files(self) -> None:
        r = self._verified()
        staging = self.cache / STAGING
        staging.mkdir(parents=True, exist_ok=True)
        for name in remote.RUN_FILES:
            src = self.cache / name
            if not src.is_file():
                continue
            copy = staging / name  # a still-growing log.jsonl is uploaded as it was at one moment
            shutil.copyfile(src, copy)
            r.put(copy, name)
            copy.unlink()

    def _prune(self) -> None:
        """Remote keep-N (the steps `keep` names stay), and step folders no marker vouches for below the newest."""
        committed, partial = self.remote.scan()
        steps = [s for s, _ in committed]
        newest = steps[-1] if steps else 0
        keep = self.keep()
        doomed = [s for s in steps[:-self.keep_last] if s not in keep] if self.keep_last > 0 else []
        for s in doomed:
            self.remote.remove_checkpoint(step_name(s))
        for name in partial:
            if int(name[len(layout.STEP_PREFIX):]) < newest:
                self.remote.remove_checkpoint(name)


# ---------------------------------------------------------------------------------- the child
def _lines(fd: int, parent: int):
    """stdin's lines; ends when it closes or the training process is gone (then nobody waits for uploads)."""
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], PARENT_POLL_S)
        if os.getppid() != parent:  # stdin may stay open: a process the run forked holds its write end
            return
        if not ready:
            continue
        chunk = os.read(fd, READ_BYTES)
        if not chunk:
            return
        buf += chunk
        *whole, buf = buf.split(b"\n")
        yield from (json.loads(line) for line in whole if line.strip())


def main() -> None:
    parent = os.getppid()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the training process ends the uploads (close), never a signal
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the messages
    lock = threading.Lock()

    def report(kind: str, value: Any) -> None:
        with lock:
            try:
                out.write(json.dumps([kind, value]) + "\n")
            except OSError:  # the training process is gone
                os._exit(0)

    def alive() -> bool:
        return os.getppid() == parent

    up: Uploader | None = None
    worker: threading.Thread | None = None
    keep: list[int] = []
    for msg in _lines(sys.stdin.fileno(), parent):
        kind = msg[0]
        if kind == "init":
            cfg = msg[1]
            up = Uploader(cfg["url"], Path(cfg["cache"]), cfg["keep_last"], report, keep=lambda: keep, alive=alive)
            up.load(cfg["state"])
            with contextlib.suppress(Exception):  # the store's library imported before the first hand-off
                up.remote = remote.Remote(up.url)
            with contextlib.suppress(OSError):  # after the imports: the training thread waits for those
                os.nice(NICE)
            report("ready", True)
            worker = threading.Thread(target=up.work, name="mirror", daemon=True)
            worker.start()
        elif kind == "checkpoint":
            keep[:] = msg[2]
            up.checkpoint(msg[1])
        elif kind == "run_files":
            up.run_files()
        elif kind == "close":
            up.finish(msg[1])
            end = time.monotonic() + msg[1] + 1.0
            while worker.is_alive() and time.monotonic() < end and alive():
                worker.join(PARENT_POLL_S)
            if not alive():
                break
            report("end", worker.is_alive() or up.pending())
            out.flush()
            break
    os._exit(0)  # an upload still running is abandoned: nobody waits for it (never a half-commit: marker last)


if __name__ == "__main__":
    main()

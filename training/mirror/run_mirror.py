"""Mirror: a run whose --out is a store URL is trained in a local cache folder and mirrored there.

Start-up, in the training thread, before anything is written: `open()` checks the URL (scheme, the
library, credentials, the bucket), `prepare()` refuses a URL holding another run (run.json of
another model config, or objects that are not a prodip run) unless --force, then pulls the newest
committed remote checkpoint that is newer than the cache's, with the run files (an empty cache on a
new machine: the run resumes where the remote one stopped). A store that does not answer at start
is not bad input: the run trains locally and the uploads are retried.

Several nodes (torchrun's LOCAL_WORLD_SIZE < WORLD_SIZE): each node trains in its own cache, rank 0
alone writes and uploads, and at start every other node pulls the checkpoint rank 0 resumes from,
committed first when only node 0 had it (training.mirror.node_caches, run by Checkpointer.pull_remote,
with `upload_checkpoint`, synchronously, in this process).

During the run, rank 0 hands each checkpoint's step to an upload *child process*
(training.store.mirror_worker; its own interpreter lock, at a lower CPU priority, so the upload's
Python work never holds the training loop's GIL): once the checkpoint's folder is renamed into place
(complete by construction, training.checkpoint.checkpoint_io) its files are hard-linked into a staging folder
(keep-N may prune the local one meanwhile), uploaded, then the run files (log.jsonl up to that step
at least), then the commit marker (training.store.remote_run), then remote keep-N. The hand-off is one line
written to a pipe, never blocking. The queue is bounded: a checkpoint still waiting when newer ones
arrive is superseded, so a slow or down store never holds memory or the training thread. Failures
are retried with a doubling back-off, with one warning line; a store holding another run (Refused)
stops the uploads and ends the run with an error as at start-up. A child that dies is said once in a
warning and restarted (at most RESTARTS times) with the newest checkpoint handed over again.
`close()` waits (up to FLUSH_S) for the last upload, so a preempted run exits on a committed remote
checkpoint; a child still uploading then is killed (its checkpoint has no marker, so it is never used).
`Mirror(section, ctx, uploader="thread")` runs the same work on a thread in this process instead: the
benchmark's peer (tests/benchmarks/bench_remote.py), not used by train.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

import training
from training import distributed as D
from training.config_sections import MirrorSection
from training.loop.rank_agreement import TrainError
from training.model.decoder import ModelConfig
from training.run_context import RunContext
from training.runfiles import layout
from training.store import remote_data
from training.store import remote_run as remote
from training.store.mirror_worker import STAGING, Refused, Uploader, env_float, step_name
from training.train_config import ConfigError, TrainConfig

__all__ = ["FLUSH_S", "Mirror", "Refused", "local_folder", "pull_data", "step_name"]

FLUSH_S = 120.0  # close(): how long the last uploads may take (PRODIP_MIRROR_FLUSH_S overrides it)
UNREACHED_FLUSH_S = 15.0  # close(): the last try of a store never reached in this run
READY_S = 30.0  # start(): how long the training thread waits, once, for the child's start-up
JOIN_GRACE_S = 2.0  # close(): beyond the flush deadline, the child's time to say it is done
RESTARTS = 3  # a child that died is restarted this many times at most (one that cannot start stops there)
WORKER = "training.store.mirror_worker"
UPLOADERS = ("process", "thread")


def local_folder(section: MirrorSection) -> Path:
    """Where a URL --out is trained: --cache, or the store's default cache folder for that URL; a local
    --out is itself the run folder."""
    if not remote.is_url(section.out):
        return Path(section.out)
    return Path(section.cache).expanduser() if section.cache else remote.cache_dir(section.out)


class Mirror:
    def __init__(self, section: MirrorSection, ctx: RunContext, uploader: str = "process"):
        if uploader not in UPLOADERS:
            raise ValueError(f"uploader {uploader!r}: one of {UPLOADERS}")
        # the run trains in the context's folder (the Trainer's is local_folder(section)), mirrored to the URL
        self.url, self.cache, self.dist, self.say = section.out.rstrip("/"), ctx.out, ctx.dist, ctx.say
        self.uploader = uploader
        self.keep: Callable[[], Container[int]] = tuple  # steps remote keep-N must not prune: start()'s
        # the upload state (reached, committed_step, refused, ...): the work itself in-process (start-up,
        # mirror_nodes' synchronous upload, the thread peer), else a copy the child's reports keep current
        self._up = Uploader(self.url, self.cache, section.keep_last, self._on_report, keep=lambda: self.keep())
        self._lock = threading.Lock()  # the child, its pipe, and its replacement after a death
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._last_step = 0  # the newest step handed over (handed over again to a restarted child)
        self._restarts = 0
        self._end_pending: bool | None = None  # the child's last word: uploads still pending at its end
        self._ready = threading.Event()  # the child is up: a checkpoint handed over is staged at once

    # the upload state lives in the Uploader: one copy of each flag, whichever side writes it
    remote = property(lambda self: self._up.remote, lambda self, v: setattr(self._up, "remote", v))
    reached = property(lambda self: self._up.reached, lambda self, v: setattr(self._up, "reached", v))
    committed_step = property(lambda self: self._up.committed_step)
    refused = property(lambda self: self._up.refused)
    start_over = property(lambda self: self._up.start_over, lambda self, v: setattr(self._up, "start_over", v))
    _checked = property(lambda self: self._up.checked, lambda self, v: setattr(self._up, "checked", v))
    _failing = property(lambda self: self._up.failing, lambda self, v: setattr(self._up, "failing", v))

    # ----------------------------------------------------------------------------- start-up
    @classmethod
    def open(cls, section: MirrorSection, ctx: RunContext) -> Mirror | None:
        """None for a local --out; else the mirror, its URL checked (TrainError: one line, nothing written)."""
        if not remote.is_url(section.out):
            return None
        if ctx.out.exists() and not ctx.out.is_dir():
            raise TrainError(f"--cache {ctx.out} is a file, not a folder")
        m = cls(section, ctx)
        if ctx.dist.is_main:
            m._reach()
        return m

    def _reach(self) -> None:
        """Rank 0 at start-up: the store checked; one that does not answer is not bad input (see the doc)."""
        try:
            self.remote = remote.Remote(self.url)
            self.remote.check()
            self.reached = True
        except remote.RemoteError as e:
            raise TrainError(str(e)) from None
        except remote.Unreachable as e:
            self._failing = True  # this outage's one warning line
            self.say(f"warning: {e}; training goes on in {self.cache}, and uploads will be retried")

    def prepare(self, model_cfg: ModelConfig, force: bool) -> None:
        """Rank 0: the URL may hold this run (else TrainError, nothing written); then the pull (see the doc)."""
        if not self.reached:
            return
        r = self.remote
        try:
            names = r.names()
            run_cfg = r.read_json(layout.RUN_CONFIG, "run config") if layout.RUN_CONFIG in names else None
        except remote.Unreachable as e:
            self.reached, self._failing = False, True
            self.say(f"warning: {e}; training goes on in {self.cache}, and uploads will be retried")
            return
        if run_cfg is not None and run_cfg.get("model") != model_cfg.to_dict() and not force:
            was = run_cfg.get("model") if isinstance(run_cfg.get("model"), dict) else {}
            diff = {k: (was.get(k), v) for k, v in model_cfg.to_dict().items() if was.get(k) != v}
            raise TrainError(f"--out {self.url} holds a run with another model config {diff} (old, new); use another "
                             "--out, or --force to start over there")
        if run_cfg is None and names and layout.RUN_MARKER not in names and not force:
            raise TrainError(f"--out {self.url} is not empty and is not a prodip run (it holds {names[0]!r}); use "
                             "another --out or --force")
        self._checked = True
        if run_cfg is not None and run_cfg.get("model") != model_cfg.to_dict():
            self.start_over = True  # --force: the old run's checkpoints are removed before the first upload
            return
        if names:
            self._pull()

    def _pull(self) -> None:
        """The newest committed remote checkpoint newer than the cache's, and the run files, into the cache."""
        local = self.cache / layout.CHECKPOINTS
        have = max((int(p.name[len(layout.STEP_PREFIX):]) for p in local.glob(layout.STEP_PREFIX + "*")
                    if p.name[len(layout.STEP_PREFIX):].isdigit()), default=0) if local.is_dir() else 0
        pulled = self.remote.pull(self.cache, self.say, newer_than=have)
        if pulled is None and not (self.cache / layout.RUN_CONFIG).is_file():
            self.remote.pull_run_files(self.cache)  # a run that died before its first checkpoint

    # ------------------------------------------------------------------------------ the run
    def start(self, keep: Callable[[], Container[int]] = tuple) -> None:
        """The uploads start (rank 0); `keep`: the steps remote keep-N must not prune (early stopping's best)."""
        self.keep = keep
        if not self.dist.is_main or self._thread is not None or self._proc is not None:
            return
        if self.uploader == "thread":
            self._thread = threading.Thread(target=self._up.work, name="mirror", daemon=True)
            self._thread.start()
            return
        with self._lock:
            self._spawn()
        self._ready.wait(READY_S)  # once, before the first step: the first checkpoints are not pruned unseen

    def _spawn(self) -> None:
        """A new child (under self._lock), told the upload state so far; its reports read on a thread."""
        env = dict(os.environ)
        root = str(Path(training.__file__).resolve().parents[1])  # train.py may run from a checkout, not installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self._proc = subprocess.Popen([sys.executable, "-m", WORKER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        self._send(["init", {"url": self.url, "cache": str(self.cache), "keep_last": self._up.keep_last,
                             "state": self._up.state()}])
        if self._last_step > self.committed_step:  # handed over before start(), or to a child that died
            self._send(["checkpoint", self._last_step, self._keep()])
        self._reader = threading.Thread(target=self._read, args=(self._proc,), name="mirror-reports", daemon=True)
        self._reader.start()

    def _send(self, msg: list[Any]) -> None:
        """One line to the child (under self._lock)."""
        self._send_to(self._proc, msg)

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with contextlib.suppress(ValueError):  # a line cut short by the child's death
                kind, value = json.loads(line)
                self._on_report(kind, value)
        rc = proc.wait()
        with self._lock:
            if self._closing or proc is not self._proc:
                return
            if self._restarts >= RESTARTS:
                self.say(f"warning: the upload process for {self.url} ended (exit code {rc}) {self._restarts + 1} "
                         "times; nothing more is uploaded in this run (run the same command again to upload it)")
                self._proc = None
                return
            self._restarts += 1
            self.say(f"warning: the upload process for {self.url} ended (exit code {rc}); it is restarted, "
                     "and the newest checkpoint is uploaded again")
            self._spawn()
            self._send(["run_files"])

    def _on_report(self, kind: str, value: Any) -> None:
        if kind == "say":
            self.say(value)
        elif kind == "state" and self.uploader == "process":
            self._up.load(value)
        elif kind == "ready":
            self._ready.set()
        elif kind == "end":
            self._end_pending = bool(value)

    def _keep(self) -> list[int]:
        return sorted(int(s) for s in self.keep())

    def checkpoint(self, step: int) -> None:
        """Upload checkpoint `step` once the writer has renamed it into place (never blocks)."""
        if not self.dist.is_main:
            return
        if self.uploader == "thread":
            self._up.checkpoint(step)
            return
        with self._lock:
            self._last_step = max(self._last_step, step)
            if self._proc is not None:  # else start() or the restart hands it over
                self._send(["checkpoint", step, self._keep()])

    def run_files(self) -> None:
        if not self.dist.is_main:
            return
        if self.uploader == "thread":
            self._up.run_files()
            return
        with self._lock:
            if self._proc is not None:
                self._send(["run_files"])

    def upload_checkpoint(self, step: int, prune: bool = True) -> bool:
        """Checkpoint `step`, then its marker, now, in this process (mirror_nodes, before start());
        False when it was gone before it could be staged."""
        return self._up.upload_checkpoint(step, prune)

    # ------------------------------------------------------------------------------ the end
    def close(self, allow_local_only: bool) -> str:
        """Wait for the uploads (up to FLUSH_S), then say where the run is. Returns why the run must end
        with an error ('' when it need not): the store held another run, or never answered while this
        process ran (unless allow_local_only)."""
        if not self.dist.is_main:
            return ""
        started = self._thread is not None or self._proc is not None
        if started:
            flush = env_float("PRODIP_MIRROR_FLUSH_S", FLUSH_S)  # a store never reached gets a short last try
            seconds = flush if self.reached else min(flush, UNREACHED_FLUSH_S)
            pending = self._join_thread(seconds) if self._thread is not None else self._join_child(seconds)
            if pending:
                self.say(f"warning: the uploads to {self.url} did not finish; the newest committed remote "
                         f"checkpoint is step {self.committed_step or 'none'}; the run is complete in {self.cache} "
                         "(run the same command again to upload it)")
            elif self.committed_step:
                self.say(f"mirrored to {self.url} (newest committed checkpoint: step {self.committed_step})")
        with contextlib.suppress(OSError):
            shutil.rmtree(self.cache / STAGING)
        if self.refused and not allow_local_only:
            return f"--out {self.refused}: nothing was uploaded; the run is only in {self.cache}"
        if not self.reached:
            msg = (f"--out {self.url} was unreachable for the whole run: nothing was uploaded; the run is only in "
                   f"{self.cache} (run the same command when the store answers to upload it)")
            if not allow_local_only:
                return msg + "; --allow-local-only accepts a local-only run"
            self.say(f"warning: {msg}")
        return ""

    def _join_thread(self, seconds: float) -> bool:
        self._up.finish(seconds)
        self._thread.join(seconds + 1.0)
        pending = self._thread.is_alive() or self._up.pending()
        self._thread = None
        return pending

    def _join_child(self, seconds: float) -> bool:
        """The run files once more, then the child's end (its last state and whether uploads are pending)."""
        with self._lock:
            self._closing = True
            proc, reader = self._proc, self._reader
            self._proc = None
            if proc is None:  # given up after RESTARTS deaths
                return True
            self._send_to(proc, ["run_files"])
            self._send_to(proc, ["close", seconds])
        reader.join(seconds + JOIN_GRACE_S)
        if proc.poll() is None:  # past the deadline: the upload in flight is cut (no marker: never used)
            proc.kill()
            proc.wait()
            reader.join(JOIN_GRACE_S)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        return self._end_pending is not False  # None: it died, or was killed, before its last word

    @staticmethod
    def _send_to(proc: subprocess.Popen, msg: list[Any]) -> None:
        """A pipe's buffer takes a line at once; a dead child's pipe is ignored (its reader restarts it)."""
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()


def pull_data(cfg: TrainConfig, kind: str, d: D.Dist, say: Callable[[str], None]) -> Path | None:
    """A --data URL: the local folder it is pulled into, once and checked (each node's local rank 0 pulls,
    one process at a time per machine; training.store.remote_data); None for a local --data."""
    if not remote.is_url(cfg.data):
        return None
    if kind != "pretrain":
        raise ConfigError(f"--data {cfg.data}: only a pretraining data folder (training.prepare) may be a URL")
    try:
        if d.local_rank == 0:  # every node needs the copy on its own disk; the others wait in agreed()
            return remote_data.pull_data(cfg.data, say)
        return remote_data.data_cache_dir("://".join(remote.split_url(cfg.data, "--data")))
    except remote.RemoteError as e:
        raise TrainError(str(e)) from None

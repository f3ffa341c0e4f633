"""Mirror: a run whose --out is a store URL is trained in a local cache folder and mirrored there.

Start-up, in the training thread, before anything is written: `open()` checks the URL (scheme, the
library, credentials, the bucket), `prepare()` refuses a URL holding another run (run.json of
another model config, or objects that are not a prodip run) unless --force, then pulls the newest
committed remote checkpoint that is newer than the cache's, with the run files (an empty cache on a
new machine: the run resumes where the remote one stopped). A store that does not answer at start
is not bad input: the run trains locally and the uploads are retried.

Several nodes (torchrun's LOCAL_WORLD_SIZE < WORLD_SIZE): each node trains in its own cache, rank 0
alone writes and uploads, and at start every other node pulls the checkpoint rank 0 resumes from,
committed first when only node 0 had it (training.loop.mirror_nodes, run by Checkpointer.pull_remote).

During the run, rank 0's background thread uploads each checkpoint once its folder is renamed into
place (complete by construction, training.checkpoint): its files are hard-linked into a staging
folder first (keep-N may prune the local one meanwhile), uploaded, then the run files (log.jsonl up to
that step at least), then the commit marker (training.remote), then remote keep-N. The queue is
bounded: a checkpoint still waiting when newer ones arrive is superseded, so a slow or down store
never holds memory or the training thread. Failures are retried with a doubling back-off, with one
warning line; `close()` waits (up to FLUSH_S) for the last upload, so a preempted run exits on a
committed remote checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Container
from pathlib import Path

from training import distributed as D
from training import layout, remote, remote_data
from training.config import ConfigError, TrainConfig
from training.loop.ranks import TrainError
from training.model import ModelConfig

STAGING = ".mirror"  # RUN_CACHE/.mirror/: hard-linked snapshots of what is being uploaded
QUEUE = 4  # checkpoints waiting at most: an older one waiting is superseded by a newer one
POLL_S = 0.02  # how often the thread looks for the checkpoint folder the writer renames into place
BACKOFF_S = (0.5, 60.0)  # first retry delay, longest (PRODIP_MIRROR_BACKOFF_MAX_S overrides it)
FLUSH_S = 120.0  # close(): how long the last uploads may take (PRODIP_MIRROR_FLUSH_S overrides it)


def _env_float(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


class Refused(Exception):  # noqa: N818 (a refusal, raised inside the thread)
    pass


def step_name(step: int) -> str:
    return f"{layout.STEP_PREFIX}{step:07d}"


class Mirror:
    def __init__(self, url: str, cache: Path, d: D.Dist, cfg: TrainConfig, say: Callable[[str], None]):
        self.url, self.cache, self.dist, self.cfg, self.say = url.rstrip("/"), cache, d, cfg, say
        self.remote: remote.Remote | None = None  # rank 0's
        self.keep: Callable[[], Container[int]] = tuple  # steps remote keep-N must not prune (early stopping's best)
        self.reached = False  # the store answered at least once in this process
        self.committed_step = 0  # the newest checkpoint this process committed remotely
        self._queue: deque[int] = deque()
        self._files_due = False
        self._closing = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._failing = False  # inside an outage: its warning is said once
        self._checked = False  # the store holds nothing but this run (prepare(), or _verified())
        self.start_over = False  # --force over another run at the URL: its checkpoints go before the first upload
        self.refused = ""  # why nothing is uploaded (the store turned out to hold another run)
        self._deadline = 0.0

    # ----------------------------------------------------------------------------- start-up
    @classmethod
    def open(cls, cfg: TrainConfig, d: D.Dist, say: Callable[[str], None]) -> Mirror | None:
        """None for a local --out; else the mirror, its URL checked (TrainError: one line, nothing written)."""
        if not remote.is_url(cfg.out):
            return None
        cache = Path(cfg.cache).expanduser() if cfg.cache else remote.cache_dir(cfg.out)
        if cache.exists() and not cache.is_dir():
            raise TrainError(f"--cache {cache} is a file, not a folder")
        m = cls(cfg.out, cache, d, cfg, say)
        if d.is_main:
            try:
                m.remote = remote.Remote(cfg.out)
                m.remote.check()
                m.reached = True
            except remote.RemoteError as e:
                raise TrainError(str(e)) from None
            except remote.Unreachable as e:
                m._failing = True  # this outage's one warning line
                say(f"warning: {e}; training goes on in {cache}, and uploads will be retried")
        return m

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
    def start(self) -> None:
        if self.dist.is_main and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="mirror", daemon=True)
            self._thread.start()

    def checkpoint(self, step: int) -> None:
        """Upload checkpoint `step` once the writer has renamed it into place (never blocks)."""
        if not self.dist.is_main:
            return
        with self._cv:
            if len(self._queue) >= QUEUE:
                self._queue.popleft()  # superseded: a newer checkpoint is on its way
            self._queue.append(step)
            self._cv.notify()

    def run_files(self) -> None:
        if not self.dist.is_main:
            return
        with self._cv:
            self._files_due = True
            self._cv.notify()

    def _work(self) -> None:
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
            if self._attempt(step):
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
            delay = min(delay * 2, _env_float("PRODIP_MIRROR_BACKOFF_MAX_S", BACKOFF_S[1]))

    def _attempt(self, step: int | None) -> bool:
        """One upload (checkpoint `step`, or the run files): True when done (or refused for good)."""
        try:
            if step is not None:
                self.upload_checkpoint(step)
            else:
                self._upload_run_files()
        except Refused as e:  # the store holds another run (seen once it answered): no upload at all
            self.refused = str(e)
            self.say(f"warning: {e}; nothing is uploaded, the run goes on in {self.cache}")
            return True
        except Exception as e:  # an outage, a full disk, a denied write: retried (the thread never dies)
            if not self._failing:
                self._failing = True
                self.say(f"warning: uploading to {self.url} failed ({e}); training goes on locally in "
                         f"{self.cache}, retrying with back-off")
            return False
        self.reached = True
        if self._failing:
            self._failing = False
            self.say(f"uploads to {self.url} resumed")
        with self._cv:
            if step is not None and self._queue and self._queue[0] == step:
                self._queue.popleft()
        return True

    def upload_checkpoint(self, step: int, prune: bool = True) -> bool:
        """Checkpoint `step`, then its marker; False when it was gone before it could be staged."""
        name = step_name(step)
        staged = self.cache / STAGING / name
        if not staged.is_dir() and not self._snapshot(step, staged):
            return False  # failed or pruned before it could be taken: a newer checkpoint supersedes it
        r = self._verified()
        self._upload_run_files()  # log.jsonl holds this step's record: it is up before the marker is
        r.upload_checkpoint(staged, step)
        self.committed_step = max(self.committed_step, step)
        shutil.rmtree(staged, ignore_errors=True)
        if prune:
            self._prune()
        return True

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
        if not self._checked:
            names = r.names()
            theirs = r.read_json(layout.RUN_CONFIG, "run config") if layout.RUN_CONFIG in names else None
            mine = layout.read_run_config(self.cache) or {}
            if theirs is not None and theirs.get("model") != mine.get("model") and not self.start_over:
                raise Refused(f"{self.url} holds a run with another model config")
            if theirs is None and names and layout.RUN_MARKER not in names and not self.start_over:
                raise Refused(f"{self.url} is not empty and is not a prodip run (it holds {names[0]!r})")
            self._checked = True
        if self.start_over:
            r.remove(layout.CHECKPOINTS, recursive=True)
            r.remove(layout.LOG)
            r.remove(remote.EXPORT_COMMIT)  # the old run's written-back exports: marker first
            r.remove(layout.EXPORT, recursive=True)
            self.start_over = False
        return r

    def _upload_run_files(self) -> None:
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
        keep_last = self.cfg.keep_last
        committed, partial = self.remote.scan()
        steps = [s for s, _ in committed]
        newest = steps[-1] if steps else 0
        keep = self.keep()
        doomed = [s for s in steps[:-keep_last] if s not in keep] if keep_last > 0 else []
        for s in doomed:
            self.remote.remove_checkpoint(step_name(s))
        for name in partial:
            if int(name[len(layout.STEP_PREFIX):]) < newest:
                self.remote.remove_checkpoint(name)

    # ------------------------------------------------------------------------------ the end
    def close(self, allow_local_only: bool) -> str:
        """Wait for the uploads (up to FLUSH_S), then say where the run is. Returns why the run must end
        with an error ('' when it need not): the store held another run, or never answered while this
        process ran (unless allow_local_only)."""
        if not self.dist.is_main:
            return ""
        if self._thread is not None:
            flush = _env_float("PRODIP_MIRROR_FLUSH_S", FLUSH_S)  # a store never reached gets a short last try
            self._deadline = time.monotonic() + (flush if self.reached else min(flush, 15.0))
            self.run_files()
            with self._cv:
                self._closing = True
                self._cv.notify()
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
            pending = self._thread.is_alive() or bool(self._queue)
            self._thread = None
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


def pull_data(cfg: TrainConfig, kind: str, d: D.Dist, say: Callable[[str], None]) -> Path | None:
    """A --data URL: the local folder it is pulled into, once and checked (each node's local rank 0 pulls,
    one process at a time per machine; training.remote_data); None for a local --data."""
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

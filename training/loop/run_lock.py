"""RunLock: one advisory lock per run folder, held by the process that writes it for the life of a run.

A second trainer, or a second resume, on a folder in use is refused at once, with one line naming
the folder and the process holding it, before it reads or writes anything there. The lock is
fcntl.flock on RUN_DIR/.prodip_lock (layout.RUN_LOCK), which holds the holder's pid, host and start
time for that message. The kernel releases a flock when its holder dies, however it dies (SIGKILL,
OOM, a power cut on the next boot), so a lock is never stale: a lock file left by a killed run is
just a file, and the next run takes it. A run that ends removes the file; a fresh --out that did not
exist is made to hold the lock, and removed again when the run ends before writing anything there.

Under torchrun only rank 0 (the rank that writes the run folder) holds it. What this does on network
file systems (NFS, Lustre, object-store mounts) is in docs/reliability.md, "One run per folder".
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from training.runfiles import layout


class RunInUse(layout.LayoutError):
    """The folder is another run's now, or cannot be locked (a training CLI's one `error:` line). The
    module imports the standard library and layout only: a holder is cheap to start (tests/test_run_lock.py)."""

ATTEMPTS = 8  # retries when the holder removed the file between our open and our lock (its run ended)
HOLDER_MAX_BYTES = 4096  # what is read of a lock file to name its holder
# errors that mean "this file system keeps no locks", not "someone holds it" (NFS without lockd, some
# FUSE mounts, Lustre mounted without -o flock)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL)


def _made_dirs(folder: Path) -> list[Path]:
    """Make `folder` and its missing parents; the ones made here, outermost first."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()][::-1]
    made = []
    for p in missing:
        try:
            p.mkdir()
            made.append(p)
        except FileExistsError:  # another process made it meanwhile: not ours to remove
            pass
    return made


def _same_file(fd: int, path: Path) -> bool:
    """`fd` is still the file at `path` (its holder may have removed it, and a third process made a new one)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holder(fd: int) -> str:
    """Who holds the lock, from the file's contents: "pid N on HOST since T" (what is known of it)."""
    try:
        info = json.loads(os.pread(fd, HOLDER_MAX_BYTES, 0).decode("utf-8"))
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict):
        return "pid unknown"
    host = f" on {info['host']}" if isinstance(info.get("host"), str) and info["host"] != socket.gethostname() else ""
    since = f", since {info['since']}" if isinstance(info.get("since"), str) else ""
    return f"pid {info.get('pid', 'unknown')}{host}{since}"


class RunLock:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / layout.RUN_LOCK
        self._fd: int | None = None
        self._made: list[Path] = []  # folders made to hold the lock: removed at release if left empty
        self.supported = True  # False on a file system without locks (then nothing is held)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Hold the lock, or RunInUse naming the folder and its holder. The folder is made if missing."""
        if self.held:
            return
        try:
            self._made = _made_dirs(self.folder)
        except OSError as e:
            raise RunInUse(f"cannot create --out {self.folder}: {e.strerror}") from None
        for _ in range(ATTEMPTS):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = holder(fd)
                os.close(fd)
                self._remove_made()
                raise RunInUse(f"{self.folder} is in use by another training run ({who}; lock file {self.path}); "
                                 "wait for it to end or stop it, or use another --out") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in NO_LOCKS:
                    raise RunInUse(f"cannot lock {self.folder}: {e.strerror} ({self.path})") from None
                self._no_locks(e)
                return
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder's run ended and removed the file between our open and our lock
        else:
            raise RunInUse(f"cannot lock {self.folder}: {self.path} keeps being replaced; is another run starting?")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "argv": sys.argv[:8]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
        self._fd = fd

    def _open(self) -> int:
        try:  # O_CLOEXEC: a child process (the mirror's uploader) must not keep the lock alive after us
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._remove_made()
            raise RunInUse(f"cannot lock {self.folder}: {e.strerror} ({self.path})") from None

    def _no_locks(self, e: OSError) -> None:
        """A file system that keeps no locks: the run goes on unguarded, and says so."""
        self.supported = False
        if self.path.is_file() and self.path.stat().st_size == 0:  # made just now, by us
            self.path.unlink(missing_ok=True)
        self._remove_made()
        print(f"warning: {self.folder}'s file system keeps no file locks ({e.strerror}): nothing stops a second "
              "run from using it at the same time; make sure none does", file=sys.stderr)

    def release(self) -> None:
        """Remove the lock file (still ours: the same file) and let go; the folders made for it, when empty."""
        fd, self._fd = self._fd, None
        if fd is not None:
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)  # while still locked: a newcomer then locks a new file
            os.close(fd)
        self._remove_made()

    def _remove_made(self) -> None:
        for p in reversed(self._made):
            try:
                p.rmdir()
            except OSError:  # not empty: the run wrote into it
                break
        self._made = []

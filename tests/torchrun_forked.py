"""`python tests/torchrun_forked.py ARGS`: `torchrun ARGS` (torch.distributed.run itself) whose worker processes
are forked from this process instead of started as cold interpreters.

Run through tests/preloaded.py, this launcher is a fork of the interpreter that imported torch and prodip's
training stack once; before the agent starts (while the process is still single-threaded) it forks a zygote,
and the agent's SubprocessHandler asks the zygote for each worker instead of `Popen([python, -u, SCRIPT, ...])`.
A worker saves the ~3.5 CPU-seconds of a cold `python training/train.py` (torch and prodip imported); each
2-rank world of the distributed tests saved ~7 of its ~17 CPU-seconds (measured on train.py, 8 steps).

A worker is set up as preloaded.py sets up a forked CLI (argv, sys.path, environment, stdio, torch's thread
count, `__main__` run by runpy, the interpreter's exit sequence), in its own session as torchrun's Popen makes
it (start_new_session: the agent signals its process group), and is the agent's own child: the zygote forks
it through an intermediate process that exits at once, and the agent is a child subreaper (prctl), so the
worker is re-parented to it and the agent waits for it (its exit status, or the signal that killed it).
What differs from a cold worker is what differs for every forked CLI (preloaded.py's docstring), and
/proc/PID/environ, which shows the zygote's initial environment, not the worker's (a test that finds the
workers through /proc, as test_preemption.py does, runs `python -m torch.distributed.run`).
PRODIP_TEST_COLD=1 (preloaded.COLD) leaves torchrun's own Popen in place.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import preloaded  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_ZYGOTE_FDS: list[int] = []


class Zygote:
    """A single-threaded fork of the launcher that forks a worker per request (a JSON line on a pipe)."""

    def __init__(self) -> None:
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the zygote: never returns
            os.close(self._req_w)
            os.close(self._rep_r)
            self._serve(req_r, rep_w)
        os.close(req_r)
        os.close(rep_w)
        self._replies = os.fdopen(self._rep_r, "r")

    @staticmethod
    def _serve(req_r: int, rep_w: int) -> None:
        _ZYGOTE_FDS.extend((req_r, rep_w))  # closed in each worker: only the agent and the zygote hold the pipes
        code = 0
        try:
            with os.fdopen(req_r, "r") as requests:
                for line in requests:  # EOF when the agent exits: so does the zygote
                    os.write(rep_w, f"{_fork_worker(json.loads(line))}\n".encode())
        except BaseException:  # noqa: BLE001 (the agent sees the closed pipe and fails the run)
            code = 1
        os._exit(code)

    def spawn(self, request: dict) -> int:
        """The worker's pid (already re-parented to this process)."""
        os.write(self._req_w, (json.dumps(request) + "\n").encode())
        reply = self._replies.readline()
        if not reply.strip():
            raise RuntimeError("torchrun_forked: the zygote exited before forking a worker")
        return int(reply)


def _fork_worker(request: dict) -> int:
    """In the zygote: fork an intermediate that forks the worker and exits; the worker's pid once the
    intermediate is reaped (the worker is then the agent's child)."""
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:
        os.close(r)
        mid = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            while os.getppid() == mid:  # not before it is the agent's child, as a Popen'd worker is from its start
                time.sleep(0.001)
            _worker(request)
        os.write(w, f"{pid}\n".encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "r") as f:
        pid = int(f.read())
    os.waitpid(mid, 0)
    return pid


def _worker(request: dict) -> None:
    """In the worker: become `python -u ARGV` as torchrun's Popen would start it."""
    os.setsid()
    for fd in _ZYGOTE_FDS:
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out, err = request["stdout"] or "/proc/self/fd/1", request["stderr"] or "/proc/self/fd/2"
    preloaded._child(request["argv"], request["cwd"], request["env"], ("/proc/self/fd/0", out, err),
                     request["path"])


class Adopted:
    """The part of `subprocess.Popen` torchrun's agent uses, for a worker re-parented to this process."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_workers() -> None:
    """Replace torchrun's worker Popen with the zygote's fork (for `python [-u] SCRIPT|-m MODULE ...`)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return  # not Linux, or refused: torchrun's own Popen
    zygote, popen = Zygote(), sh.SubprocessHandler._popen
    path = sys.path[1:]  # a fresh interpreter's sys.path past the script's folder (preloaded._child set it)

    def forked(self, args: tuple, env: dict[str, str]):
        argv = [str(a) for a in args]
        if argv[0] != sys.executable or argv[1:2] != ["-u"] or not preloaded.preloadable([argv[0], *argv[2:]]):
            return popen(self, args, env)
        pid = zygote.spawn({"argv": [argv[0], *argv[2:]], "env": {**env, "PYTHONUNBUFFERED": "1"},
                            "cwd": os.getcwd(), "path": path, "stdout": getattr(self._stdout, "name", None),
                            "stderr": getattr(self._stderr, "name", None)})
        return Adopted(pid, argv)

    sh.SubprocessHandler._popen = forked


def main(argv: list[str]) -> None:
    if not os.environ.get(preloaded.COLD):
        fork_workers()
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])

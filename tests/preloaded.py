"""CLI runs forked from a preloaded interpreter: `python training/train.py ...` without the cold start.

A cold `python` that imports torch and prodip's training stack spends ~4-5 CPU-seconds before the
CLI's first line runs; the suite starts a few hundred of them. `run(argv)` takes the same argv a test
gives `subprocess.run` and, when it is `[sys.executable, SCRIPT.py | -m MODULE, ...]`, runs it in a
child forked from one multiprocessing forkserver that imported those modules once (Python's own
forkserver: a single-threaded server that forks a fresh child per request). The child is a real
process (its own pid, exit status, signals, files), set up as a fresh interpreter would be:
argv, sys.path[0], the working folder, the environment, stdin, stdout/stderr on files (unbuffered
under PYTHONUNBUFFERED), the torch thread count from OMP_NUM_THREADS (the OpenMP runtime read the
variable when the server imported torch), `__main__` run by runpy, then Python's own exit sequence
(non-daemon threads joined, atexit run, SystemExit's code).

What a fork cannot give: a fresh hash seed (every child shares the server's; PYTHONHASHSEED is
not honoured) and import-time effects of environment variables on the preloaded modules (prodip
reads its variables at call time; tests/test_preloaded.py checks the run matches a cold one). Tests
that are about the cold start itself, and README commands run as shown, keep `subprocess`.
PRODIP_TEST_COLD=1 sends every run through `subprocess.run` (to compare, or to bisect a difference).
tests/torchrun_forked.py does the same for torchrun's workers (the distributed tests' launcher).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
# imported once by the server: what `python training/train.py` and `python -m export|serving` import first
PRELOAD = ["torch", "numpy", "safetensors.torch", "sentencepiece", "pydantic", "training.train", "training.trainer",
           "training.prepare.prepare_cli", "export.__main__", "serving.__main__", "preloaded"]
COLD = "PRODIP_TEST_COLD"

_ctx: mp.context.ForkServerContext | None = None
forked_runs = 0  # this session's forked CLI runs (conftest prints the count at the end)
_path: list[str] | None = None


def _python_path() -> list[str]:
    """sys.path of a fresh `python` past its first entry (the script's folder), not pytest's."""
    global _path
    if _path is None:
        out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                             capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()).stdout
        _path = json.loads(out)
    return _path


def _context() -> mp.context.ForkServerContext:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def preloadable(argv: Sequence[str]) -> bool:
    """`python SCRIPT.py ...` or `python -m MODULE ...` with this interpreter, and not opted out."""
    if os.environ.get(COLD) or len(argv) < 2 or str(argv[0]) != sys.executable:
        return False
    first = str(argv[1])
    return (first == "-m" and len(argv) > 2) or (first.endswith(".py") and not first.startswith("-"))


def _stdio(fd: int, unbuffered: bool, errors: str, line_buffering: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, encoding="utf-8", errors=errors, write_through=True)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors=errors, line_buffering=line_buffering)


def _child(argv: list[str], cwd: str, env: dict[str, str], paths: tuple[str, str, str], path: list[str]) -> None:
    """In the forked child: become `python ARGV` in CWD with ENV, then exit as the interpreter would."""
    import atexit
    import runpy
    import threading
    import traceback

    stdin, stdout, stderr = paths
    for fd, file, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_APPEND),
                            (2, stderr, os.O_WRONLY | os.O_APPEND)):
        f = os.open(file, flags)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = sys.__stdout__ = _stdio(1, unbuffered, "strict", False)
    sys.stderr = sys.__stderr__ = _stdio(2, unbuffered, "backslashreplace", True)  # stderr is line-buffered
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[:] = [cwd, *path]
            _forget(argv[2])
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[1])
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [os.path.dirname(script), *path]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  (the interpreter joins non-daemon threads first)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing left to flush
                stream.flush()
        os._exit(code & 0xFF)


def _forget(name: str) -> None:
    """A cold `python -m NAME` has not imported what it runs; the server may have (runpy would warn)."""
    module = sys.modules.get(name)
    if module is not None and not hasattr(module, "__path__"):  # a package stays: runpy runs NAME.__main__
        del sys.modules[name]
    sys.modules.pop(f"{name}.__main__", None)


class Forked:
    """A running forked CLI: the part of `subprocess.Popen` the tests use (pid, poll, wait, signals)."""

    def __init__(self, argv: Sequence[str], *, cwd: str | os.PathLike = REPO, env: dict[str, str] | None = None,
                 input: str | bytes | None = None, log: str | os.PathLike | None = None):
        """LOG: stdout and stderr both appended to that file (as `stdout=f, stderr=STDOUT`), else captured."""
        self.args = [str(a) for a in argv]
        self._dir = tempfile.TemporaryDirectory(prefix="forked-")
        d = Path(self._dir.name)
        stdin = d / "stdin"
        stdin.write_bytes(input.encode() if isinstance(input, str) else (input or b""))
        self._out, self._err = (Path(log), Path(log)) if log is not None else (d / "stdout", d / "stderr")
        self._out.touch()
        self._err.touch()
        env = dict(os.environ if env is None else env)
        paths = (str(stdin), str(self._out), str(self._err))
        self._proc = _context().Process(target=_child, args=(self.args, str(cwd), env, paths, _python_path()),
                                        daemon=False)
        self._proc.start()
        global forked_runs
        forked_runs += 1
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self._proc.kill()

    def output(self, text: bool = True) -> tuple[str | bytes, str | bytes]:
        out, err = self._out.read_bytes(), self._err.read_bytes()
        return (out.decode(), err.decode()) if text else (out, err)

    def close(self) -> None:
        self._proc.close() if self.poll() is not None else None
        self._dir.cleanup()


def run(argv: Sequence[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
        timeout: float | None = None, input: str | bytes | None = None, check: bool = False,
        preexec_fn: Callable[[], None] | None = None, text: bool = False,
        capture_output: bool = False, **kw) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, ...)` for a `python` CLI, forked from the preloaded server."""
    if not preloadable(argv) or not capture_output or preexec_fn is not None or kw:  # a closure cannot be sent
        kw |= {"preexec_fn": preexec_fn} if preexec_fn else {}
        return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, timeout=timeout, input=input, check=check,
                              text=text, capture_output=capture_output, **kw)
    proc = Forked(argv, cwd=os.getcwd() if cwd is None else cwd, env=env, input=input)
    try:
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            out, err = proc.output(text)
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
        out, err = proc.output(text)
    finally:
        proc.close()
    done = subprocess.CompletedProcess(proc.args, rc, out, err)
    if check:
        done.check_returncode()
    return done


def popen(argv: Sequence[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
          stdout: IO | None = None, stderr: int | None = None) -> Forked | subprocess.Popen:
    """`subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)` for a `python` CLI: forked, both streams
    appended to f's file; any other use is a plain Popen."""
    name = getattr(stdout, "name", None)
    if preloadable(argv) and isinstance(name, str) and stderr == subprocess.STDOUT:
        stdout.flush()
        return Forked(argv, cwd=os.getcwd() if cwd is None else cwd, env=env, log=name)
    return subprocess.Popen([str(a) for a in argv], cwd=cwd, env=env, stdout=stdout, stderr=stderr)

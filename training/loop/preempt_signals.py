"""Preemption: SIGTERM or SIGUSR1 stops a run cleanly, on a checkpoint, every rank at the same step.

Rented and spot machines, SLURM (`scancel`, `--signal=USR1@60`), Kubernetes and torchrun (which
forwards SIGTERM to its workers) send one of these before they reclaim the machine. The first one
makes the run finish the step it is in, write a checkpoint, and exit with EXIT_PREEMPTED (3) and one
line: `preempted at step N by SIGTERM; checkpoint step_000000N written; run the same command to resume`.
A second signal ends the process at once, killed by it (a shell reports 128 + N): checkpoints are
written atomically (training.checkpoint.checkpoint_io), so the newest complete one still loads. A repeat within
REPEAT_AFTER_S of the first is the same request delivered twice (SLURM signals every process of a
step, and torchrun forwards the SIGTERM it got to its workers as well) and is ignored;
PRODIP_SIGNAL_REPEAT_S overrides that window. Once the window has passed, the next poll restores
the default action, so a second signal kills even a process stuck inside a collective.

Under torchrun every rank must stop at the same step even when only one got the signal: every rank
calls `Preemption.poll()` at the same point of every step, and it all-reduces the signal number (MAX)
in one 4-byte collective. On CUDA the result is read one step later, when it has long arrived, so
the poll never stalls the GPU pipeline (no per-step host sync); the run then stops one step later.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

from training.runfiles.cli_harness import EXIT_PREEMPTED, Preempted

__all__ = ["EXIT_PREEMPTED", "SIGNALS", "Preempted", "Preemption", "signal_name"]
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REPEAT_AFTER_S = 1.0  # a repeat sooner than this is one request delivered twice (see the module doc)
REPEAT_ENV = "PRODIP_SIGNAL_REPEAT_S"


def repeat_after_s() -> float:
    try:
        return max(0.0, float(os.environ.get(REPEAT_ENV, REPEAT_AFTER_S)))
    except ValueError:
        return REPEAT_AFTER_S


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Preemption:
    """The signal handlers of one training loop and the agreed stop decision (see the module doc)."""

    def __init__(self, d, device: torch.device):  # d: training.distributed.Dist
        self.dist, self.device = d, device
        self.received = 0  # the signal number this process got (0: none)
        self.received_at = 0.0  # time.monotonic() of it
        self.repeat_after_s = repeat_after_s()
        self._defaulted = False  # SIG_DFL installed: the kernel acts on the next signal
        self._previous: dict[int, object] = {}
        self._flag: torch.Tensor | None = None  # the all-reduced flag, on the device
        self._host: torch.Tensor | None = None  # CUDA: pinned copy of the last poll's result
        self._done: torch.cuda.Event | None = None  # CUDA: recorded after that copy

    def install(self) -> Preemption:
        """Catch SIGNALS (main thread only: Python delivers signals there; elsewhere this is a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def restore(self) -> None:
        """The handlers from before install() (not after ignore_signals(): the process is exiting)."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def ignore_signals(self) -> None:
        """The preemption checkpoint is on disk and the process is about to exit EXIT_PREEMPTED: ignore
        SIGNALS from now on, in this process."""
        if self._previous:
            for s in SIGNALS:
                signal.signal(s, signal.SIG_IGN)
            self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        who = f"rank {self.dist.rank}: " if self.dist.enabled else ""
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()
            if self.repeat_after_s == 0:
                self._default_action()
            # os.write, not print: a handler can run while the main thread is inside print()
            os.write(2, f"{who}{signal_name(signum)} received: finishing this step, then writing a checkpoint; "
                        "send it again to exit at once without one\n".encode())
        elif time.monotonic() - self.received_at >= self.repeat_after_s:  # a second request: die by it
            os.write(2, f"{who}second {signal_name(signum)}: exiting at once, without a checkpoint\n".encode())
            self._default_action()
            os.kill(os.getpid(), signum)

    def _default_action(self) -> None:
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        self._defaulted = True

    def poll(self) -> int:
        """The signal number to stop on (0: go on), the same on every rank. Call on every rank, at the
        same point of every step: it is a collective under torchrun."""
        if self.received and self._previous and not self._defaulted and \
                time.monotonic() - self.received_at >= self.repeat_after_s:
            self._default_action()  # from now on the kernel acts on a second signal, whatever the process is doing
        if not self.dist.enabled:
            return self.received
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._flag.fill_(self.received)  # a kernel, not a host-to-device copy: no sync
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        if self.device.type != "cuda":
            return int(self._flag.item())  # gloo: the all-reduce has already completed
        agreed = 0
        if self._done is None:
            self._host, self._done = torch.zeros(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()
        else:  # the previous poll's copy was queued a step ago: done by now, so this wait is free
            self._done.synchronize()
            agreed = int(self._host.item())
        self._host.copy_(self._flag, non_blocking=True)
        self._done.record()
        return agreed

"""PreemptionStop: a SIGTERM/SIGUSR1 (training.loop.preempt_signals: the handlers and the agreed poll) ends the
run on a checkpoint of the step every rank agreed on, then raises preempt.Preempted (exit 3)."""

from __future__ import annotations

from collections.abc import Callable

from training.checkpoint import checkpoint_io as ckpt
from training.loop import preempt_signals as preempt
from training.loop.checkpointer import Checkpointer
from training.run_context import RunContext


class PreemptionStop:
    def __init__(self, ctx: RunContext, checkpointer: Checkpointer):
        self.dist, self.checkpointer, self.log = ctx.dist, checkpointer, ctx.log
        self.signals = preempt.Preemption(ctx.dist, ctx.device)
        self.installed = False

    def install(self) -> None:
        self.signals.install()
        self.installed = True

    def should_stop(self) -> int:
        """The signal number every rank agrees on at this step (0: none); see training.loop.preempt_signals."""
        return self.signals.poll()

    def stop(self, step: int, signum: int, save: Callable[[], None]) -> None:
        """Checkpoint this step (unless it has one), wait until it is on disk, raise preempt.Preempted."""
        name = preempt.signal_name(signum)
        if step > self.checkpointer.saved_step:
            save()
        # once it is on disk, further signals are ignored while the process exits: torchrun SIGTERMs the
        # ranks still exiting as soon as one has exited, and each should still exit EXIT_PREEMPTED
        self.checkpointer.finish(then=self.signals.ignore_signals)
        done = f"checkpoint {ckpt.step_dir_name(step)} written" if step else "no checkpoint (no step was trained)"
        self.log({"event": "preempted", "step": step, "signal": name})
        raise preempt.Preempted(f"preempted at step {step} by {name}; {done}; run the same command to resume"
                                if self.dist.is_main else "")

    def restore(self) -> None:
        """The signal handlers as they were before install() (idempotent)."""
        if self.installed:
            self.signals.restore()

    close = restore  # the Trainer closes its components alike

"""StepReads: a step's loss and grad norm are read on the host only when something needs them.

With the device-side skip (fused AdamW), steps queue here with their values still on the device; one
read (one host sync) at the next log, eval, save or stop takes them all, judges them in step order
(`judge`: the runtime checks, False drops the update) and writes their records. Without it, every
step is read before its update. The newest step's record is kept (`current`) for the loop to
complete (validation) before it is written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from training.config_sections import ChecksSection
from training.loop.step import StepResult


class StepReads:
    def __init__(self, cfg: ChecksSection, *, deferred: bool, judge: Callable[[StepResult], bool],
                 record: Callable[[StepResult], dict], write: Callable[[dict], None]):
        self.cfg, self.deferred = cfg, deferred
        self.judge, self.record, self.write = judge, record, write
        self.pending: list[StepResult] = []  # steps not yet read, oldest first
        self.current: dict | None = None  # the newest step's record, read but not yet written

    def should_read_now(self, step: int) -> bool:
        """Must this step's values be read before its update? Always without the device-side skip; with
        it, only where a check needs them: --on-spike skip, the gradient-flow cadence."""
        cfg = self.cfg
        return (not self.deferred or cfg.on_spike == "skip"
                or bool(cfg.grad_flow_every and step % cfg.grad_flow_every == 0))

    def add(self, r: StepResult) -> None:
        self.pending.append(r)

    def read(self, step: int) -> dict | None:
        """Read the pending steps' values (one host sync for all), judge them in step order and write
        their records; the record of `step` (the newest) is returned, not written (None: dropped)."""
        pending, self.pending = self.pending, []
        todo = [r for r in pending if r.applied is None]
        if todo:
            cols = [torch.stack([r.loss.double(), r.grad_norm.double(),
                                 (r.first_bad if r.first_bad is not None else torch.zeros((), device=r.loss.device)).double()])
                    for r in todo]
            for r, (loss, norm, first) in zip(todo, torch.stack(cols).tolist(), strict=True):
                r.loss, r.grad_norm = loss, norm
                r.first_bad = int(first) if r.first_bad is not None else None
        for r in pending:
            if r.applied is None:
                r.applied = self.judge(r)
            if not r.applied:
                continue
            if r.step == step:
                self.current = self.record(r)
            else:
                self.write_current(self.record(r))
        return self.current

    def write_current(self, rec: dict | None) -> None:
        if rec is not None:
            self.write(rec)
        self.current = None

    def flush(self, step: int) -> None:
        """Every queued step's record written (before a checkpoint of it, or at the end)."""
        self.write_current(self.read(step))

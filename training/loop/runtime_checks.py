"""RuntimeChecks: the runtime gates on a step's read values (non-finite loss or gradient, gradient
flow on its cadence, loss spikes). `judge(r)` False drops the step's update (--on-nonfinite skip,
--on-spike skip; a deferred step's non-finite update was already skipped on the device); a failure
that must stop the run raises GateError, no non-finite update having reached the weights."""

from __future__ import annotations

import json
import math

import torch

from training import gates
from training.config_sections import ChecksSection
from training.loop.step import StepResult
from training.run_context import RunContext
from training.runfiles import layout


class RuntimeChecks:
    def __init__(self, section: ChecksSection, ctx: RunContext, trainable: list[tuple[str, torch.nn.Parameter]]):
        self.cfg, self.dist, self.device, self.out = section, ctx.dist, ctx.device, ctx.out
        self.trainable, self.log, self.say = trainable, ctx.log, ctx.say
        self.monitor = gates.RuntimeMonitor(section)  # type: ignore[arg-type]  # reads spike_window, spike_zscore
        self.nonfinite_skips = 0

    def should_check_flow(self, step: int) -> bool:
        every = self.cfg.grad_flow_every
        return bool(every and step % every == 0)

    def judge(self, r: StepResult) -> bool:
        cfg, d, step = self.cfg, self.dist, r.step
        bad = not (math.isfinite(r.loss) and math.isfinite(r.grad_norm))
        # deferred: loss and norm are already the same on every rank (reduced), as was the device's decision
        if bad if r.deferred else d.any(bad, self.device):
            return self.nonfinite(r)
        if not r.deferred and self.should_check_flow(step):
            flow = gates.gradient_flow_from_grads(self.trainable)
            if not flow.passed:
                raise gates.GateError(f"step {step}: runtime gradient-flow check failed: {flow.detail}")
        r.spike_z = self.monitor.observe(step, r.loss)
        if r.spike_z and cfg.on_spike == "skip":  # never deferred: --on-spike skip reads every step
            self.log({"event": "loss_spike_skipped", "step": step, "loss": r.loss, "loss_spike_z": r.spike_z})
            self.say(f"warning: step {step}: loss spike (z={r.spike_z:.1f}); batch skipped (--on-spike skip)")
            return False
        if r.spike_z:
            self.say(f"warning: step {step}: loss spike (z={r.spike_z:.1f})")
        return True

    def nonfinite(self, r: StepResult) -> bool:
        """The diagnostic (nonfinite.json, a log event); False (skip) while skips are allowed, else GateError."""
        cfg, step = self.cfg, r.step
        diag = self.monitor.nonfinite_diagnostic(step, r.loss, r.grad_norm, self.trainable, r.position,
                                                 first_index=r.first_bad if r.deferred else None)
        if self.dist.is_main:
            (self.out / layout.NONFINITE).write_text(json.dumps(diag, indent=2))
            self.log({"event": "nonfinite", **diag})
        self.nonfinite_skips += 1
        if cfg.on_nonfinite == "skip" and self.nonfinite_skips <= cfg.max_nonfinite_skips:
            self.say(f"warning: step {step}: non-finite loss/grad ({diag['detail']}); batch skipped "
                     f"({self.nonfinite_skips}/{cfg.max_nonfinite_skips})")
            return False
        raise gates.GateError(f"step {step}: non-finite loss or gradient ({diag['detail']}); stopped before the "
                              f"optimizer step, weights untouched; diagnostic in {self.out / layout.NONFINITE}")

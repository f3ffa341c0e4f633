"""Preflight: the pre-flight gates (training.gates) on the exact object that trains, one verdict for
every rank. A failed report is saved for the user where no run lives yet (RunFolder) and raised.

The gates judge an object, not only weights: a resume on another device, dtype, world size, with
--compile, FSDP, activation checkpointing or the fused optimizer switched trains a different object
than the one that passed. The passed report records that setting; a resume that changes it runs the
gates again on the resumed model (they leave no trace: weights, gradients, RNG and data position are
as before), and the new report keeps the earlier ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from training import gates
from training.data.loaders import TrainingData
from training.loop.run_folder import RunFolder
from training.loop.step import ModelViews
from training.run_context import RunContext
from training.runfiles import layout
from training.telemetry.step_metrics import flops_per_token
from training.train_config import TrainConfig


class Preflight:
    def __init__(self, cfg: TrainConfig, ctx: RunContext, folder: RunFolder, registry: dict | None = None):
        # the whole config: the gates' PreflightContext hands it to each gate (training.gates)
        self.cfg, self.dist, self.folder, self.say = cfg, ctx.dist, folder, ctx.say
        self.registry = registry  # None: every gate of training.gates.gate_registry.PREFLIGHT

    def run(self, views: ModelViews, data: TrainingData, new_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
            peak_flops: float | None) -> gates.GateReport:
        """The passed report (commit() writes it), or GateError with the failed one on every rank."""
        cfg, d, v = self.cfg, self.dist, views
        report = gates.GateReport(skipped_by_user=list(cfg.skip_gates), setting=self.setting(v))
        ctx = gates.PreflightContext(model=v.forward_model, raw_model=v.model, optimizer_factory=new_optimizer,
                                     batches=data, cfg=cfg, model_cfg=v.model.cfg, device=v.device,
                                     autocast=v.autocast, dist=d,
                                     flops_per_token=flops_per_token(v.model.cfg, cfg.seq_len), peak_flops=peak_flops)
        report.extend(gates.run_preflight(ctx, skip=cfg.skip_gates, gates=self.registry))
        failed_ranks = d.ranks_where(not report.passed, v.device)
        if failed_ranks and report.passed:
            report.results.append(gates.GateResult(
                "all_ranks", False, value=float(len(failed_ranks)), threshold="0",
                detail=f"pre-flight gates failed on rank(s) {failed_ranks}; see their errors"))
        self.say(report.table())
        if not report.passed:
            self.folder.save_failed_gates(report)
            raise gates.GateError(report)
        self.say(report.summary())
        return report

    def setting(self, views: ModelViews) -> dict:
        """What the verdicts depend on beyond the weights, read from the objects where they say it."""
        cfg, device = self.cfg, views.device
        with views.autocast():
            dtype = str(torch.get_autocast_dtype(device.type)) if torch.is_autocast_enabled(device.type) else "fp32"
        return {"device": device.type, "world_size": self.dist.world_size, "dtype": dtype.removeprefix("torch."),
                "compile": cfg.compile, "fsdp": cfg.fsdp and (cfg.fsdp_reshard_after_forward or "no-reshard"),
                "activation_checkpointing": cfg.activation_checkpointing,
                "fused_optimizer": bool(views.optimizer.defaults.get("fused")),
                "skipped_by_user": sorted(cfg.skip_gates)}

    def changed_since(self, out: Path, views: ModelViews) -> dict[str, list]:
        """A resumed run: what differs from the setting its gates passed under, {name: [then, now]}
        (empty: the verdicts still hold), the same answer on every rank (rank 0 reads gates.json)."""
        changed: dict[str, list] = {}
        if self.dist.is_main:
            now = self.setting(views)
            try:
                then = gates.GateReport.load(out / layout.GATES).setting
            except (OSError, layout.LayoutError) as e:
                then = {}
                self.say(f"warning: {out / layout.GATES} unreadable ({e}); running the pre-flight gates again")
            changed = {k: [then.get(k), v] for k, v in now.items() if then.get(k) != v}
        if self.dist.broadcast_ints([int(bool(changed))], views.device)[0] and not changed:
            changed = {"on rank 0": [None, None]}  # the other ranks know only that it changed
        return changed

    def rerun(self, out: Path, views: ModelViews, data: TrainingData,
              new_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], peak_flops: float | None,
              step: int, changed: dict) -> gates.GateReport:
        """The gates again on a resumed run whose setting changed; the passed report keeps the earlier one."""
        if self.dist.is_main:
            what = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in ((k, *ab) for k, ab in changed.items()))
            self.say(f"resumed at step {step} with another setting ({what}): running the pre-flight gates again")
        report = self.run(views, data, new_optimizer, peak_flops)
        if self.dist.is_main:
            try:
                old = gates.GateReport.load(out / layout.GATES)
                report.previous = [*old.previous, {**old.to_dict(), "previous": []}]
            except (OSError, layout.LayoutError):
                pass  # said above; nothing readable to keep
            report.setting = {**report.setting, "resumed_at_step": step}
        return report

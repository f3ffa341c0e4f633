"""Preflight: the pre-flight gates (training.gates) on the exact object that trains, one verdict for
every rank. A failed report is saved for the user where no run lives yet (RunFolder) and raised."""

from __future__ import annotations

from collections.abc import Callable

import torch

from training import distributed as D
from training import gates
from training.config import TrainConfig
from training.data import TrainingData
from training.loop.run_folder import RunFolder
from training.loop.step import ModelViews
from training.metrics import flops_per_token


class Preflight:
    def __init__(self, cfg: TrainConfig, d: D.Dist, folder: RunFolder, say: Callable[[str], None]):
        self.cfg, self.dist, self.folder, self.say = cfg, d, folder, say

    def run(self, views: ModelViews, data: TrainingData, new_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
            peak_flops: float | None) -> gates.GateReport:
        """The passed report (commit() writes it), or GateError with the failed one on every rank."""
        cfg, d, v = self.cfg, self.dist, views
        report = gates.GateReport(skipped_by_user=list(cfg.skip_gates))
        ctx = gates.PreflightContext(model=v.forward_model, raw_model=v.model, optimizer_factory=new_optimizer,
                                     batches=data, cfg=cfg, model_cfg=v.model.cfg, device=v.device,
                                     autocast=v.autocast, dist=d,
                                     flops_per_token=flops_per_token(v.model.cfg, cfg.seq_len), peak_flops=peak_flops)
        report.extend(gates.run_preflight(ctx, skip=cfg.skip_gates))
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

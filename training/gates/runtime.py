"""Runtime gates, every training step: the non-finite diagnostic, loss spikes by rolling z-score,
the gradient-flow check from the step's own gradients, and clipping that keeps a NaN visible.

The pre-flight `gradient_flow` gate (training.gates.model_gates) judges its one backward pass with the
same `gradient_flow_from_grads`, so pre-flight and mid-run checks cannot drift apart.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from training.runfiles.gate_results import GateResult

if TYPE_CHECKING:
    from training.config_sections import ChecksSection
    from training.train_config import TrainConfig

MIN_SPIKE_HISTORY = 10  # no z-score before this many steps: early losses are too noisy

NamedParams = Iterable[tuple[str, torch.nn.Parameter]]


def full_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient as a plain tensor: DTensor (FSDP2) shards are gathered (a collective: every rank calls)."""
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _is_row_sparse(name: str) -> bool:
    # Embedding rows of tokens absent from the batch legitimately get zero gradient.
    return "embed" in name


def gradient_flow_from_grads(named_params: NamedParams) -> GateResult:
    """Every trainable parameter has a gradient that exists, is finite and is nonzero.

    Beyond "nonzero": a matrix (not an embedding) with whole rows of exactly zero gradient is a
    dead slice (e.g. a fused kernel dropping some heads' gradients): it fails too, with the count.
    """
    missing, nonfinite, zero, dead = [], [], [], []
    n = 0
    for pname, p in named_params:
        if not p.requires_grad:
            continue
        n += 1
        if p.grad is None:
            missing.append(pname)
            continue
        g = full_grad(p.grad)
        if not bool(torch.isfinite(g).all()):
            nonfinite.append(pname)
        elif not bool((g != 0).any()):
            zero.append(pname)
        elif g.dim() >= 2 and not _is_row_sparse(pname):
            rows = (g.reshape(g.shape[0], -1) != 0).any(dim=1)
            if not bool(rows.all()):
                dead.append(f"{pname} ({int((~rows).sum())} of {rows.numel()} rows)")
    bad = len(missing) + len(nonfinite) + len(zero) + len(dead)
    parts = [f"{label}: {', '.join(names)}" for label, names in (
        ("no gradient", missing), ("non-finite gradient", nonfinite), ("all-zero gradient", zero),
        ("rows with zero gradient", dead)) if names]
    detail = "; ".join(parts) if parts else f"all {n} trainable parameters receive finite, nonzero gradients"
    if not n:  # a gate that judged nothing has failed: no trainable parameter reached it
        detail = "no trainable parameter to judge"
    return GateResult("gradient_flow", bad == 0 and n > 0, value=float(n - bad), threshold=f"{n} of {n} parameters",
                      detail=detail)


class RuntimeMonitor:
    """Loss-spike z-scores over a rolling window, and the non-finite diagnostic."""

    def __init__(self, cfg: ChecksSection | TrainConfig):  # reads spike_window and spike_zscore only
        self.window, self.z = cfg.spike_window, cfg.spike_zscore
        self.history: list[float] = []
        self.spikes: list[tuple[int, float]] = []

    def zscore(self, loss: float) -> float | None:
        """z of `loss` against the rolling window (None until enough history)."""
        if len(self.history) < max(MIN_SPIKE_HISTORY, self.window // 2):
            return None
        mu = statistics.fmean(self.history)
        sd = statistics.pstdev(self.history) or 1e-12
        return (loss - mu) / sd

    def observe(self, step: int, loss: float) -> float | None:
        """Record a finite loss; returns its z-score when it is a spike (z > threshold), else None."""
        z = self.zscore(loss)
        spike = round(z, 2) if z is not None and z > self.z else None
        if spike is not None:
            self.spikes.append((step, spike))
        self.history = (self.history + [loss])[-self.window:]
        return spike

    @staticmethod
    def nonfinite_diagnostic(step: int, loss: float, grad_norm: float, named_params: NamedParams,
                             position: dict, first_index: int | None = None) -> dict:
        """What nonfinite.json records: the step, loss, norm, first bad parameter and data position.

        The first bad parameter is found by scanning the gradients now, or, when the step's gradients
        are gone (read after later steps), given as `first_index` (first_nonfinite_index; -1: none)."""
        first = None
        if first_index is not None:
            names = [name for name, p in named_params if p.requires_grad]
            first = names[first_index] if 0 <= first_index < len(names) else None
        else:
            for name, p in named_params:
                if p.grad is None:
                    continue
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # this rank's shard suffices
                if not bool(torch.isfinite(g).all()):
                    first = name
                    break
        detail = f"loss={loss}, grad_norm={grad_norm}" + (f", first non-finite gradient in {first}" if first else "")
        return {"step": step, "loss": repr(loss), "grad_norm": repr(grad_norm), "first_nonfinite_param": first,
                "data_position": position, "detail": detail}


def first_nonfinite_index(named_params: NamedParams, norms: torch.Tensor | None = None) -> torch.Tensor:
    """The index (among trainable parameters) of the first one whose gradient (this rank's shard) is
    not finite, -1 if none: a 0-d tensor on the device, computed without a host sync. `norms`: the
    per-gradient norms clip_grad_norm_finite already computed (in the same order), so the gradients
    are not read a second time (~1 % of a CPU step of the small preset)."""
    trainable = [p for _, p in named_params if p.requires_grad]
    have = [(i, p.grad) for i, p in enumerate(trainable) if p.grad is not None]
    if not have:
        return torch.tensor(-1)
    if norms is None or len(norms) != len(have):
        grads = [g.to_local() if hasattr(g, "to_local") else g for _, g in have]
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads)])
    bad = ~torch.isfinite(norms)
    if len(have) == len(trainable):  # arange is made on the device; a list would be a (syncing) copy
        idx = torch.arange(len(have), device=bad.device)
    else:
        idx = torch.tensor([i for i, _ in have], device=bad.device)
    return torch.where(bad, idx, len(trainable)).min().where(bad.any(), -1)


def clip_grad_norm_finite(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                          norms_out: list[torch.Tensor] | None = None) -> torch.Tensor:
    """`clip_grad_norm_` (max_norm <= 0: no clipping), except that a non-finite total norm leaves the
    gradients untouched: clip_grad_norm_ would multiply every gradient by NaN, and the non-finite
    diagnostic could no longer name the parameter where it started. Returns the total norm.
    No host sync: a non-finite norm is replaced by 0 on the device, which clips by exactly 1.0.
    `norms_out`: receives the per-gradient norms (fp32, one tensor) where the gradients are plain tensors
    of one device and dtype, the total being their norm exactly as get_total_norm computes it."""
    utils = torch.nn.utils
    params = [p for p in parameters if p.grad is not None]
    limit = max_norm if max_norm > 0 else math.inf
    if not hasattr(utils, "get_total_norm"):  # torch < 2.6
        return utils.clip_grad_norm_(params, limit)
    grads = [p.grad for p in params]
    if norms_out is not None and grads and type(grads[0]) is torch.Tensor and len(
            {(g.device, g.dtype) for g in grads}) == 1 and all(type(g) is torch.Tensor for g in grads):
        norms = torch._foreach_norm(grads)  # get_total_norm's own two steps, for one device/dtype group
        total = torch.linalg.vector_norm(torch.stack(norms))
        norms_out.append(torch.stack([n.float() for n in norms]))
    else:
        total = utils.get_total_norm(grads)
    if math.isfinite(limit):
        utils.clip_grads_with_norm_(params, limit, torch.where(torch.isfinite(total), total, 0.0))
    return total

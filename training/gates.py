"""Gates: checks that must pass before GPU hours are spent or a model is shipped.

Every gate returns a `GateResult` (name, passed, measured value, threshold, detail). A `GateReport`
prints them as a table, saves them as JSON (`RUN_DIR/gates.json`) and says whether to proceed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class GateResult:
    name: str
    passed: bool
    value: float | str | None = None
    threshold: str | None = None
    detail: str = ""
    skipped: bool = False  # skipped on request (--skip-gate): recorded, never silently

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GateReport:
    results: list[GateResult] = field(default_factory=list)
    skipped_by_user: list[str] = field(default_factory=list)

    def extend(self, results: Iterable[GateResult]) -> None:
        self.results.extend(results)

    @property
    def failed(self) -> list[GateResult]:
        return [r for r in self.results if not r.passed and not r.skipped]

    @property
    def passed(self) -> bool:
        return not self.failed

    def table(self) -> str:
        rows = ["| gate | result | value | threshold | detail |", "|---|---|---|---|---|"]
        for r in self.results:
            verdict = "SKIPPED (by user)" if r.skipped else ("pass" if r.passed else "FAIL")
            v = f"{r.value:.4g}" if isinstance(r.value, float) else ("" if r.value is None else str(r.value))
            rows.append(f"| {r.name} | {verdict} | {v} | {r.threshold or ''} | {r.detail} |")
        return "\n".join(rows)

    def summary(self) -> str:
        if self.passed:
            extra = f" ({len(self.skipped_by_user)} SKIPPED by user: {', '.join(self.skipped_by_user)})" if self.skipped_by_user else ""
            return f"all {len(self.results)} gates passed{extra}"
        return f"{len(self.failed)} of {len(self.results)} gates FAILED: {', '.join(r.name for r in self.failed)}"

    def to_dict(self) -> dict:
        return {"passed": self.passed, "summary": self.summary(), "skipped_by_user": self.skipped_by_user,
                "results": [r.to_dict() for r in self.results]}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False))


class GateError(RuntimeError):
    """A failed gate: stops the run. str() is a one-line summary, then the details."""

    def __init__(self, report_or_message: GateReport | str):
        if isinstance(report_or_message, GateReport):
            self.report = report_or_message
            lines = [f"pre-flight gates failed, training not started: {report_or_message.summary()}"]
            lines += [f"  {r.name}: {r.detail}" for r in report_or_message.failed]
            msg = "\n".join(lines)
        else:
            self.report = None
            msg = report_or_message
        super().__init__(msg)


@dataclass
class PreflightContext:
    """Everything a pre-flight gate may look at. `model` is the exact object that trains (after
    DDP/FSDP wrapping and torch.compile); `raw_model` the underlying Transformer."""

    model: object
    raw_model: object
    optimizer_factory: object
    batches: object
    cfg: object
    model_cfg: object
    device: object
    autocast: object
    dist: object
    flops_per_token: float
    peak_flops: float | None


# ------------------------------------------------------------------------------- gradient flow
def gradient_flow_from_grads(named_params) -> GateResult:
    """Every trainable parameter has a gradient that exists, is finite and is nonzero."""
    import torch

    missing, nonfinite, zero = [], [], []
    n = 0
    for name, p in named_params:
        if not p.requires_grad:
            continue
        n += 1
        g = p.grad
        if g is None:
            missing.append(name)
            continue
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        if not torch.isfinite(g).all():
            nonfinite.append(name)
        elif not g.abs().sum().item() > 0:
            zero.append(name)
    bad = len(missing) + len(nonfinite) + len(zero)
    parts = []
    for label, names in (("no gradient", missing), ("non-finite gradient", nonfinite), ("all-zero gradient", zero)):
        if names:
            parts.append(f"{label}: {', '.join(names)}")
    detail = "; ".join(parts) if parts else f"all {n} trainable parameters receive finite, nonzero gradients"
    return GateResult("gradient_flow", bad == 0, value=float(n - bad), threshold=f"{n} of {n} parameters", detail=detail)


def frozen_parameters(model) -> GateResult:
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return GateResult("frozen_parameters", not frozen, value=float(len(frozen)), threshold="0",
                      detail=("frozen by mistake? " + ", ".join(frozen)) if frozen else "every parameter is trainable")


def gradient_flow(ctx: PreflightContext) -> GateResult:
    """One forward/backward on a real training batch through the exact object that trains."""
    model, raw = ctx.model, ctx.raw_model
    state = ctx.batches.train.state_dict()
    batch = ctx.batches.train.next_batch(ctx.cfg.batch_size)
    ctx.batches.train.load_state_dict(state)  # the gate consumes no training data
    x, y = batch[0].to(ctx.device), batch[1].to(ctx.device)
    mask = batch[2].to(ctx.device) if len(batch) > 2 else None
    for p in raw.parameters():
        p.grad = None
    with ctx.autocast():
        _, loss = model(x, y, loss_mask=mask)
    loss.backward()
    result = gradient_flow_from_grads(raw.named_parameters())
    for p in raw.parameters():
        p.grad = None
    return result


# ------------------------------------------------------------------------------------ data
def data_gate(ctx: PreflightContext, k: int = 64) -> list[GateResult]:
    import hashlib

    import numpy as np

    loader = ctx.batches.train
    out = []
    vocab = ctx.model_cfg.vocab_size
    # token ids below the vocabulary size (checked over every shard, cheaply: max of each)
    stream = getattr(loader, "stream", None)
    if stream is not None:
        hi = max(int(np.max(p)) for p in stream.parts if len(p))
        out.append(GateResult("data.token_range", hi < vocab, value=float(hi), threshold=f"< {vocab}",
                              detail=f"max token id {hi}, vocabulary {vocab}"))
        first = [loader.window(loader.window_index(g)).tobytes() for g in range(min(k, loader.n_windows))]
        digests = [hashlib.sha1(w).hexdigest() for w in first]
        dup = len(digests) - len(set(digests))
        out.append(GateResult("data.no_repeats", dup == 0, value=float(dup), threshold="0 repeated windows",
                              detail=f"{dup} repeats among the first {len(digests)} training windows"))
        val = ctx.batches.val
        if val is not None:
            vh = {hashlib.sha1(row.numpy().tobytes()).hexdigest() for b in val(ctx.cfg.eval_batches) for row in b[0]}
            th = {hashlib.sha1(w[:-1]).hexdigest() for w in
                  (loader.window(loader.window_index(g)) for g in range(min(4 * k, loader.n_windows)))}
            th = {hashlib.sha1(np.frombuffer(w, dtype=np.int64)[:-1].tobytes()).hexdigest() for w in first} | th
            overlap = len(vh & th)
            out.append(GateResult("data.train_val_disjoint", overlap == 0, value=float(overlap), threshold="0",
                                  detail=f"{overlap} validation windows also appear in training"))
    return out


def tokenizer_gates(ctx: PreflightContext) -> list[GateResult]:
    rep = ctx.batches.data_report
    if not rep or "gates" not in rep:
        return [GateResult("tokenizer", True, detail="no fertility report in the data folder (prepared elsewhere)")]
    return [GateResult(**{k: v for k, v in g.items() if k in GateResult.__dataclass_fields__}) for g in rep["gates"]]


PREFLIGHT = {
    "gradient_flow": lambda ctx: [gradient_flow(ctx)],
    "frozen_parameters": lambda ctx: [frozen_parameters(ctx.raw_model)],
    "data": data_gate,
    "tokenizer": tokenizer_gates,
}


def run_preflight(ctx: PreflightContext, skip: list[str] | tuple = ()) -> list[GateResult]:
    results: list[GateResult] = []
    for name, fn in PREFLIGHT.items():
        if name in skip:
            results.append(GateResult(name, False, detail="SKIPPED by --skip-gate", skipped=True))
            continue
        for r in fn(ctx):
            if r.name in skip:
                r.skipped = True
            results.append(r)
    unknown = set(skip) - set(PREFLIGHT) - {r.name for r in results}
    if unknown:
        raise GateError(f"--skip-gate: unknown gate(s) {sorted(unknown)}; known: {sorted(PREFLIGHT)}")
    return results


# --------------------------------------------------------------------------------- runtime
class RuntimeMonitor:
    """Loss-spike z-scores over a rolling window, and the non-finite diagnostic."""

    def __init__(self, cfg):
        self.window, self.z = cfg.spike_window, cfg.spike_zscore
        self.history: list[float] = []

    def observe(self, step: int, loss: float) -> float | None:
        import statistics

        spike = None
        if len(self.history) >= max(10, self.window // 2):
            mu = statistics.fmean(self.history)
            sd = statistics.pstdev(self.history) or 1e-12
            z = (loss - mu) / sd
            if z > self.z:
                spike = round(z, 2)
        self.history = (self.history + [loss])[-self.window:]
        return spike

    @staticmethod
    def nonfinite_diagnostic(step: int, loss: float, grad_norm: float, named_params, position: dict) -> dict:
        import torch

        first = None
        for name, p in named_params:
            if p.grad is not None and not torch.isfinite(p.grad).all():
                first = name
                break
        detail = f"loss={loss}, grad_norm={grad_norm}" + (f", first non-finite gradient in {first}" if first else "")
        return {"step": step, "loss": repr(loss), "grad_norm": repr(grad_norm), "first_nonfinite_param": first,
                "data_position": position, "detail": detail}

"""Gates: checks that must pass before GPU hours are spent or a model is shipped.

Every gate returns a `GateResult` (name, passed, measured value, threshold, detail). A `GateReport`
prints them as a table, saves them as JSON (`RUN_DIR/gates.json`) and says whether to proceed.

Pre-flight gates run before step 1 on the exact object that will train (after DDP/FSDP wrapping and
torch.compile) and leave no trace: gradients, RNG state, data position and weights are as before.

    gradient_flow        one forward/backward on a real batch: every trainable parameter gets a
                         gradient that exists, is finite and nonzero (and no dead rows)   gates_model
    frozen_parameters    no parameter has requires_grad=False by mistake                  gates_model
    compiled_vs_eager    logits and every gradient of the trained object agree with a fresh eager
                         reference model, within a dtype-aware tolerance                  gates_model
    overfit_one_batch    a copy of the model halves its loss on one fixed batch           gates_model
    throughput           MFU floor and backward/forward time ratio (enforced on CUDA)     gates_model
    data                 token ids < vocab, no repeated windows, train/val disjoint       gates_data
    tokenizer            fertility and balance of the tokenizer (from the data report)    gates_data

Runtime gates (train.py, every step): non-finite loss/gradient stops before the optimizer step
(`RuntimeMonitor.nonfinite_diagnostic`), loss spikes by rolling z-score (`RuntimeMonitor.observe`),
and the gradient-flow check repeated from the step's own gradients (`gradient_flow_from_grads`).
The random-init twin gate lives in `training.evaluate.twin_gate` (see `twin`).
"""

from __future__ import annotations

import importlib
import json
import math
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

GATES_FILE = "gates.json"
GATES_FORMAT = 1


@dataclass
class GateResult:
    name: str
    passed: bool
    value: float | str | None = None
    threshold: str | None = None
    detail: str = ""
    skipped: bool = False  # skipped on request (--skip-gate): recorded, never silently
    seconds: float | None = None  # what the gate cost

    def to_dict(self) -> dict:
        d = asdict(self)
        if isinstance(self.value, float) and not math.isfinite(self.value):
            d["value"] = repr(self.value)  # strict JSON has no NaN/inf
        return d


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
    def skipped(self) -> list[GateResult]:
        return [r for r in self.results if r.skipped]

    @property
    def passed(self) -> bool:
        return not self.failed

    def table(self) -> str:
        rows = ["| gate | result | value | threshold | detail |", "|---|---|---|---|---|"]
        for r in self.results:
            verdict = "SKIPPED (by user)" if r.skipped else ("pass" if r.passed else "FAIL")
            v = f"{r.value:.4g}" if isinstance(r.value, float) else ("" if r.value is None else str(r.value))
            detail = r.detail.replace("|", "\\|").replace("\n", " ")
            rows.append(f"| {r.name} | {verdict} | {v} | {r.threshold or ''} | {detail} |")
        return "\n".join(rows)

    def _skip_note(self) -> str:
        names = list(dict.fromkeys(self.skipped_by_user + [r.name for r in self.skipped]))
        return f" ({len(names)} SKIPPED by user: {', '.join(names)})" if names else ""

    def summary(self) -> str:
        if self.passed:
            return f"all {len(self.results) - len(self.skipped)} gates passed{self._skip_note()}"
        return (f"{len(self.failed)} of {len(self.results)} gates FAILED: {', '.join(r.name for r in self.failed)}"
                f"{self._skip_note()}")

    def to_dict(self) -> dict:
        return {"prodip_gates": GATES_FORMAT, "passed": self.passed, "summary": self.summary(),
                "skipped_by_user": self.skipped_by_user, "failed": [r.name for r in self.failed],
                "results": [r.to_dict() for r in self.results]}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: Path) -> GateReport:
        d = json.loads(Path(path).read_text())
        fields_ = GateResult.__dataclass_fields__
        return cls([GateResult(**{k: v for k, v in r.items() if k in fields_}) for r in d["results"]],
                   list(d.get("skipped_by_user", [])))


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


def require_passed(run_dir: Path) -> GateReport:
    """For export/shipping: RUN_DIR/gates.json must exist and record passing pre-flight gates."""
    path = Path(run_dir) / GATES_FILE
    if not path.is_file():
        raise GateError(f"{path} not found: this run never passed its pre-flight gates; nothing is exported")
    report = GateReport.load(path)
    if not report.passed:
        raise GateError(f"{path}: {report.summary()}; nothing is exported")
    return report


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
def _local(g):
    """A gradient as a plain tensor: DTensor (FSDP2) shards are gathered (a collective: every rank calls)."""
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _is_row_sparse(name: str) -> bool:
    # Embedding rows of tokens absent from the batch legitimately get zero gradient.
    return "embed" in name


def gradient_flow_from_grads(named_params, row_sparse: Container[str] | Callable[[str], bool] | None = None,
                             name: str = "gradient_flow") -> GateResult:
    """Every trainable parameter has a gradient that exists, is finite and is nonzero.

    Beyond "nonzero": a matrix (not an embedding) with whole rows of exactly zero gradient is a
    dead slice (e.g. a fused kernel dropping some heads' gradients): it fails too, with the count.
    """
    import torch

    sparse = (row_sparse if callable(row_sparse) else (lambda n: n in row_sparse)) if row_sparse else _is_row_sparse
    missing, nonfinite, zero, dead = [], [], [], []
    n = 0
    for pname, p in named_params:
        if not p.requires_grad:
            continue
        n += 1
        if p.grad is None:
            missing.append(pname)
            continue
        g = _local(p.grad)
        if not bool(torch.isfinite(g).all()):
            nonfinite.append(pname)
        elif not bool((g != 0).any()):
            zero.append(pname)
        elif g.dim() >= 2 and not sparse(pname):
            rows = (g.reshape(g.shape[0], -1) != 0).any(dim=1)
            if not bool(rows.all()):
                dead.append(f"{pname} ({int((~rows).sum())} of {rows.numel()} rows)")
    bad = len(missing) + len(nonfinite) + len(zero) + len(dead)
    parts = []
    for label, names in (("no gradient", missing), ("non-finite gradient", nonfinite), ("all-zero gradient", zero),
                         ("rows with zero gradient", dead)):
        if names:
            parts.append(f"{label}: {', '.join(names)}")
    detail = "; ".join(parts) if parts else f"all {n} trainable parameters receive finite, nonzero gradients"
    return GateResult(name, bad == 0, value=float(n - bad), threshold=f"{n} of {n} parameters", detail=detail)


def frozen_parameters(model) -> GateResult:
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return GateResult("frozen_parameters", not frozen, value=float(len(frozen)), threshold="0",
                      detail=("frozen by mistake? " + ", ".join(frozen)) if frozen else "every parameter is trainable")


def gradient_flow(ctx: PreflightContext) -> GateResult:
    """One forward/backward on a real training batch through the exact object that trains."""
    from training.gates_model import peek_batch, zero_grads

    x, y, mask = peek_batch(ctx)
    raw = ctx.raw_model
    zero_grads(raw)
    with ctx.autocast():
        _, loss = ctx.model(x, y, loss_mask=mask)
    loss.backward()
    result = gradient_flow_from_grads(raw.named_parameters())
    zero_grads(raw)
    return result


# ------------------------------------------------------------------------------------ registry
def _lazy(module: str, fn: str, many: bool = True) -> Callable:
    """Gate implementations import torch and friends; load them only when the gate runs."""
    def call(ctx: PreflightContext) -> list[GateResult]:
        out = getattr(importlib.import_module(module), fn)(ctx)
        return list(out) if many else [out]
    call.__name__ = fn
    return call


# Order matters: cheap and decisive first; each gate's name is what --skip-gate takes (a group
# name skips all of its results, a full result name like data.no_repeats skips just that one).
PREFLIGHT: dict[str, Callable[[PreflightContext], list[GateResult]]] = {
    "frozen_parameters": lambda ctx: [frozen_parameters(ctx.raw_model)],
    "gradient_flow": lambda ctx: [gradient_flow(ctx)],
    "compiled_vs_eager": _lazy("training.gates_model", "compiled_vs_eager", many=False),
    "overfit_one_batch": _lazy("training.gates_model", "overfit_one_batch", many=False),
    "throughput": _lazy("training.gates_model", "throughput"),
    "data": _lazy("training.gates_data", "data_gate"),
    "tokenizer": _lazy("training.gates_data", "tokenizer_gates"),
}


def data_gate(ctx: PreflightContext) -> list[GateResult]:
    from training.gates_data import data_gate as impl

    return impl(ctx)


def tokenizer_gates(ctx: PreflightContext) -> list[GateResult]:
    from training.gates_data import tokenizer_gates as impl

    return impl(ctx)


def _crashed(name: str, e: BaseException) -> GateResult:
    """A gate whose own forward/backward raises (a fused kernel that crashes) fails by name."""
    msg = " ".join(str(e).split())[:400]
    return GateResult(name, False, detail=f"crashed: {type(e).__name__}: {msg}")


def run_preflight(ctx: PreflightContext, skip: list[str] | tuple = (),
                  gates: dict[str, Callable] | None = None) -> list[GateResult]:
    """Run every pre-flight gate (or `gates`), recording skips; RNG state is left untouched."""
    import torch

    registry = PREFLIGHT if gates is None else gates
    known = set(PREFLIGHT) | set(registry)
    unknown = [s for s in skip if s not in known and s.split(".")[0] not in known]
    if unknown:
        raise GateError(f"--skip-gate: unknown gate(s) {sorted(unknown)}; known: {sorted(known)}")
    results: list[GateResult] = []
    dev = getattr(ctx, "device", None)
    devices = [dev] if dev is not None and getattr(dev, "type", "") == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # gates (fresh reference models) draw no training RNG
        for name, fn in registry.items():
            if name in skip:
                results.append(GateResult(name, False, detail="SKIPPED by --skip-gate", skipped=True))
                continue
            t0 = time.perf_counter()
            try:
                out = fn(ctx)
            except (RuntimeError, ValueError, TypeError, AssertionError, ArithmeticError) as e:
                out = [_crashed(name, e)]
                zero = getattr(ctx.raw_model, "zero_grad", None)
                if zero:
                    zero(set_to_none=True)
            dt = time.perf_counter() - t0
            for r in out:
                r.seconds = round(dt / len(out), 3)
                if r.name in skip:
                    r.skipped = True
                    r.detail = f"SKIPPED by --skip-gate; measured: {r.detail}"
                results.append(r)
    if devices:  # the gates' model copies are gone: hand their memory back, and measure training's own peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(devices[0])
    return results


# --------------------------------------------------------------------------------- runtime
DEFAULT_MIN_SPIKE_HISTORY = 10  # no z-score before this many steps: early losses are too noisy


class RuntimeMonitor:
    """Loss-spike z-scores over a rolling window, and the non-finite diagnostic."""

    def __init__(self, cfg):
        self.window, self.z = cfg.spike_window, cfg.spike_zscore
        self.history: list[float] = []
        self.spikes: list[tuple[int, float]] = []

    def zscore(self, loss: float) -> float | None:
        """z of `loss` against the rolling window (None until enough history)."""
        import statistics

        if len(self.history) < max(DEFAULT_MIN_SPIKE_HISTORY, self.window // 2):
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
    def nonfinite_diagnostic(step: int, loss: float, grad_norm: float, named_params, position: dict) -> dict:
        import torch

        first = None
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


def clip_grad_norm_finite(parameters, max_norm: float):
    """`clip_grad_norm_` (max_norm <= 0: no clipping), except that a non-finite total norm leaves the
    gradients untouched: clip_grad_norm_ would multiply every gradient by NaN, and the non-finite
    diagnostic could no longer name the parameter where it started. Returns the total norm."""
    import torch

    utils = torch.nn.utils
    params = [p for p in parameters if p.grad is not None]
    limit = max_norm if max_norm > 0 else math.inf
    if not hasattr(utils, "get_total_norm"):  # torch < 2.6
        return utils.clip_grad_norm_(params, limit)
    total = utils.get_total_norm([p.grad for p in params])
    full = total.full_tensor() if hasattr(total, "full_tensor") else total
    if math.isfinite(limit) and bool(torch.isfinite(full)):
        utils.clip_grads_with_norm_(params, limit, total)
    return total


# ------------------------------------------------------------------------------------ twin
def twin(model, token_windows, **kwargs) -> GateResult:
    """The random-init twin gate (shared with evaluation): `training.evaluate.twin_gate`."""
    from training.evaluate import twin_gate

    return twin_gate(model, None, token_windows, **kwargs)

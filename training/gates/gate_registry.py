"""The pre-flight gates: a registry, and `run_preflight`, which runs them before step 1 on the exact
object that will train (after DDP/FSDP2 wrapping and torch.compile) and leaves no trace: gradients,
RNG state, data position and weights are as before.

    frozen_parameters    no parameter has requires_grad=False by mistake                       model
    gradient_flow        one forward/backward on a real batch: every trainable parameter gets a
                         gradient that exists, is finite and nonzero (and no dead rows)         model
    compiled_vs_eager    logits and every gradient of the trained object, on the real micro-batch,
                         agree with a fresh eager reference model within a measured tolerance   model
    overfit_one_batch    the model halves its loss on one fixed batch (weights restored after)  model
    throughput           MFU floor and backward/forward time ratio (enforced on CUDA)           model
    data                 token ids < vocab, no repeated windows, train/val disjoint             data
    tokenizer            fertility and balance of the tokenizer (from the data report)          data
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from training.gates.context import PreflightContext
from training.gates.data_gates import data_gates, tokenizer_gates
from training.gates.model_gates import (
    compiled_vs_eager,
    frozen_parameters,
    gradient_flow,
    overfit_one_batch,
    throughput,
)
from training.runfiles.gate_results import GateError, GateResult

Gate = Callable[[PreflightContext], list[GateResult]]

# Order matters: cheap and decisive first; each gate's name is what --skip-gate takes (a group
# name skips all of its results, a full result name like data.no_repeats skips just that one).
# The names are also listed in training.gates.gate_names (the leaf config.py validates against);
# tests/test_architecture.py checks the two agree.
PREFLIGHT: dict[str, Gate] = {
    "frozen_parameters": lambda ctx: [frozen_parameters(ctx.raw_model)],
    "gradient_flow": lambda ctx: [gradient_flow(ctx)],
    "compiled_vs_eager": lambda ctx: [compiled_vs_eager(ctx)],
    "overfit_one_batch": lambda ctx: [overfit_one_batch(ctx)],
    "throughput": throughput,
    "data": data_gates,
    "tokenizer": tokenizer_gates,
}

# What a gate's own forward/backward may raise (a fused kernel that crashes, an out-of-memory):
# it then fails by name instead of ending the run with a traceback.
GATE_CRASHES = (RuntimeError, ValueError, TypeError, AssertionError, ArithmeticError)


def _crashed(name: str, e: BaseException) -> GateResult:
    msg = " ".join(str(e).split())[:400]
    return GateResult(name, False, detail=f"crashed: {type(e).__name__}: {msg}")


def _check_skips(skip: Sequence[str], registry: dict[str, Gate]) -> None:
    known = set(PREFLIGHT) | set(registry)
    unknown = [s for s in skip if s not in known and s.split(".")[0] not in known]
    if unknown:
        raise GateError(f"--skip-gate: unknown gate(s) {sorted(unknown)}; known: {sorted(known)}")


def run_preflight(ctx: PreflightContext, skip: Sequence[str] = (),
                  gates: dict[str, Gate] | None = None) -> list[GateResult]:
    """Run every pre-flight gate (or `gates`), recording skips; RNG state is left untouched."""
    registry = PREFLIGHT if gates is None else gates
    _check_skips(skip, registry)
    results: list[GateResult] = []
    devices = [ctx.device] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # gates (fresh reference models) draw no training RNG
        for name, fn in registry.items():
            if name in skip:
                results.append(GateResult(name, False, detail="SKIPPED by --skip-gate", skipped=True))
                continue
            t0 = time.perf_counter()
            try:
                out = fn(ctx)
            except GATE_CRASHES as e:
                out = [_crashed(name, e)]
                ctx.raw_model.zero_grad(set_to_none=True)
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

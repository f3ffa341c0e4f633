"""Gates: checks that must pass before GPU hours are spent or a model is shipped.

    names.py      the pre-flight gates' names, what --skip-gate takes (a leaf: config validates against it)
    result.py     GateResult, GateReport, GateError, require_passed (torch-free)
    context.py    PreflightContext: everything a pre-flight gate may look at (torch-free)
    preflight.py  the registry of pre-flight gates and run_preflight
    model.py      gradient flow, frozen parameters, compiled vs eager, overfit one batch, throughput
    data.py       data gates (token range, repeats, train/val overlap) and tokenizer gates
    runtime.py    RuntimeMonitor (loss spikes, non-finite diagnostic), clip_grad_norm_finite,
                  gradient_flow_from_grads: the checks of every training step

The random-init twin gate is evaluation's: `training.evaluate.twin_gate`.

Importing this package pulls no torch: prepare, fertility, export and the model card use it for
results only. The names that need torch (`run_preflight` and the runtime checks) load on first use.
Modules inside the package import their siblings, never this `__init__`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from training.gates.context import PreflightContext
from training.gates.result import GateError, GateReport, GateResult, require_passed

if TYPE_CHECKING:
    from training.gates.preflight import run_preflight
    from training.gates.runtime import RuntimeMonitor, clip_grad_norm_finite, gradient_flow_from_grads

__all__ = ["GateError", "GateReport", "GateResult", "PreflightContext", "RuntimeMonitor", "clip_grad_norm_finite",
           "gradient_flow_from_grads", "require_passed", "run_preflight"]

_RUNTIME = ("RuntimeMonitor", "clip_grad_norm_finite", "gradient_flow_from_grads")


def __getattr__(name: str) -> object:
    """The torch-backed names, imported when first asked for (PEP 562)."""
    if name == "run_preflight":
        from training.gates.preflight import run_preflight

        return run_preflight
    if name in _RUNTIME:
        from training.gates import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

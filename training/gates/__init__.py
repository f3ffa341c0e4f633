"""Gates: checks that must pass before GPU hours are spent or a model is shipped.

    gate_names.py the pre-flight gates' names, what --skip-gate takes (a leaf: config validates against it)
    (training.runfiles.gate_results: GateResult, GateReport, GateError, require_passed: torch-free, in the base)
    context.py    PreflightContext: everything a pre-flight gate may look at (torch-free)
    gate_registry.py  the registry of pre-flight gates and run_preflight
    model_gates.py    gradient flow, frozen parameters, compiled vs eager, overfit one batch, throughput
    data_gates.py     data gates (token range, repeats, train/val overlap) and tokenizer gates
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
from training.runfiles.gate_results import GateError, GateReport, GateResult, require_passed

if TYPE_CHECKING:
    from training.gates.gate_registry import run_preflight
    from training.gates.runtime import RuntimeMonitor, clip_grad_norm_finite, gradient_flow_from_grads

__all__ = ["GateError", "GateReport", "GateResult", "PreflightContext", "RuntimeMonitor", "clip_grad_norm_finite",
           "gradient_flow_from_grads", "require_passed", "run_preflight"]

_RUNTIME = ("RuntimeMonitor", "clip_grad_norm_finite", "gradient_flow_from_grads")


def __getattr__(name: str) -> object:
    """The torch-backed names, imported when first asked for (PEP 562)."""
    if name == "run_preflight":
        from training.gates.gate_registry import run_preflight

        return run_preflight
    if name in _RUNTIME:
        from training.gates import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

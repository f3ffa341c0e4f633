"""The names of the pre-flight gates, in the order they run: what `--skip-gate` takes. A leaf (imports
nothing), so training.train_config validates a name without importing the gates (torch) and without the
cycle config -> gates -> config; training.gates.gate_registry registers exactly these names."""

from __future__ import annotations

PREFLIGHT_NAMES = (
    "frozen_parameters",
    "gradient_flow",
    "compiled_vs_eager",
    "overfit_one_batch",
    "throughput",
    "data",  # a group: its results are data.token_range, data.no_repeats, ...
    "tokenizer",
)


def is_known_gate(name: str) -> bool:
    """A pre-flight gate (`gradient_flow`), a group of them (`data`) or one result (`data.no_repeats`)."""
    return name in PREFLIGHT_NAMES or name.split(".")[0] in PREFLIGHT_NAMES

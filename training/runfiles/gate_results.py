"""What every gate returns and how a set of them is reported: torch-free, so the stages that only
read or write gate results (prepare, fertility, export, the model card) never import torch.

A `GateResult` holds a name, pass/fail, the measured value, the threshold and a sentence a person
can act on. A `GateReport` prints them as a table, saves them as strict JSON (`RUN_DIR/gates.json`)
and says whether to proceed; `require_passed` is what export and shipping call.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from training.runfiles import layout

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
    # what the verdicts were reached under beyond the weights (device, dtype, compile, wrapping, world
    # size; training.loop.preflight_runner): a resume that changes it runs the gates again
    setting: dict = field(default_factory=dict)
    # this run's earlier reports (oldest first), kept when a resume ran the gates again
    previous: list[dict] = field(default_factory=list)

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
                "results": [r.to_dict() for r in self.results], "setting": self.setting, "previous": self.previous}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: Path) -> GateReport:
        """RUN_DIR/gates.json, checked: format version, each result's name and verdict, and a stored
        verdict that agrees with its results; layout.LayoutError naming the file otherwise."""
        what = "gate report"
        d = layout.read_json(path, what, required={"passed": bool, "results": list},
                             version=("prodip_gates", GATES_FORMAT))
        fields_ = GateResult.__dataclass_fields__
        results = []
        for i, r in enumerate(d["results"]):
            if not isinstance(r, dict):
                raise layout.LayoutError(f"{path}: {what}: results[{i}] must be an object")
            layout.check_schema(r, f"{path}: results[{i}]", what, {"name": str, "passed": bool})
            results.append(GateResult(**{k: v for k, v in r.items() if k in fields_}))
        skipped = d.get("skipped_by_user", [])
        setting, previous = d.get("setting", {}), d.get("previous", [])
        report = cls(results, list(skipped) if isinstance(skipped, list) else [],
                     setting if isinstance(setting, dict) else {}, previous if isinstance(previous, list) else [])
        if report.passed != d["passed"]:
            raise layout.LayoutError(f"{path}: {what} says passed={d['passed']} but its results say otherwise "
                                     "(edited or damaged)")
        return report


class GateError(RuntimeError):
    """A failed gate: stops the run. str() is a one-line summary, then the details."""

    def __init__(self, report_or_message: GateReport | str):
        if isinstance(report_or_message, GateReport):
            self.report: GateReport | None = report_or_message
            lines = [f"pre-flight gates failed, training not started: {report_or_message.summary()}"]
            lines += [f"  {r.name}: {r.detail}" for r in report_or_message.failed]
            msg = "\n".join(lines)
        else:
            self.report = None
            msg = report_or_message
        super().__init__(msg)


def require_passed(run_dir: Path) -> GateReport:
    """For export/shipping: RUN_DIR/gates.json must exist and record passing pre-flight gates."""
    path = Path(run_dir) / layout.GATES
    if not path.is_file():
        raise GateError(f"{path} not found: this run never passed its pre-flight gates; nothing is exported")
    try:
        report = GateReport.load(path)
    except (layout.LayoutError, KeyError, TypeError) as e:
        raise GateError(f"unreadable gate report: {e}; nothing is exported") from None
    if not report.results:
        raise GateError(f"{path}: the gate report records no gates; nothing is exported")
    if not report.passed:
        raise GateError(f"{path}: {report.summary()}; nothing is exported")
    return report

"""training/runfiles/gate_results.py on hand-built results: the verdict of a set of gates (a skipped gate never
fails it, an empty set records nothing), the table, strict JSON, and the gates.json that export and
shipping require. Expected strings are written from the format, not read back from the code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from training.runfiles import layout
from training.runfiles.gate_results import GateError, GateReport, GateResult, require_passed


def ok(name: str = "a") -> GateResult:
    return GateResult(name, True, value=0.5, threshold="<= 1", detail="fine")


def bad(name: str = "b") -> GateResult:
    return GateResult(name, False, value=2.0, threshold="<= 1", detail="too high")


def test_non_finite_values_are_written_as_strict_json() -> None:
    for v, text in ((math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")):
        d = GateResult("g", False, value=v).to_dict()
        assert d["value"] == text
        json.dumps(d, allow_nan=False)  # strict JSON: raises on a float NaN
    d = GateResult("g", True, value=1.5, threshold="t", detail="d", skipped=True, seconds=0.25).to_dict()
    assert d == {"name": "g", "passed": True, "value": 1.5, "threshold": "t", "detail": "d", "skipped": True,
                 "seconds": 0.25}
    assert GateResult("g", True, value="text").to_dict()["value"] == "text"


def test_verdict_failed_skipped_and_summary() -> None:
    skipped = GateResult("s", False, skipped=True, detail="skipped")
    r = GateReport([ok(), skipped])
    assert r.passed and r.failed == [] and r.skipped == [skipped]
    assert r.summary() == "all 1 gates passed (1 SKIPPED by user: s)"
    r = GateReport([ok(), bad(), bad("c"), skipped], skipped_by_user=["x", "s"])
    assert not r.passed and [g.name for g in r.failed] == ["b", "c"]
    assert r.summary() == "2 of 4 gates FAILED: b, c (2 SKIPPED by user: x, s)"
    assert GateReport([ok()]).summary() == "all 1 gates passed"
    r = GateReport()
    r.extend([ok("a"), ok("b")])
    assert [g.name for g in r.results] == ["a", "b"] and r.summary() == "all 2 gates passed"


def test_table_rows() -> None:
    rows = GateReport([ok(), GateResult("b|c", False, value=None, detail="x|y\nz"),
                       GateResult("s", False, value="3", skipped=True), GateResult("f", True, value=1234.5678)]).table()
    assert rows.splitlines() == [
        "| gate | result | value | threshold | detail |", "|---|---|---|---|---|",
        "| a | pass | 0.5 | <= 1 | fine |",
        "| b|c | FAIL |  |  | x\\|y z |",
        "| s | SKIPPED (by user) | 3 |  |  |",
        "| f | pass | 1235 |  |  |"]


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "gates.json"
    report = GateReport([ok(), GateResult("n", True, value=math.nan, detail="বাংলা")], skipped_by_user=["x"],
                        setting={"device": "cpu"}, previous=[{"passed": False}])
    report.save(path)
    text = path.read_text(encoding="utf-8")
    assert '\n  "prodip_gates": 1,' in text and "বাংলা" in text and text.endswith("}\n")
    d = json.loads(text)
    assert d["passed"] is True and d["summary"] == "all 2 gates passed (1 SKIPPED by user: x)" and d["failed"] == []
    assert (d["skipped_by_user"], d["setting"], d["previous"]) == (["x"], {"device": "cpu"}, [{"passed": False}])
    back = GateReport.load(path)
    assert [g.name for g in back.results] == ["a", "n"] and back.results[1].value == "nan"
    assert back.results[0] == ok() and back.skipped_by_user == ["x"]
    assert back.setting == {"device": "cpu"} and back.previous == [{"passed": False}]
    failed = GateReport([bad()])
    failed.save(path)
    assert json.loads(path.read_text())["failed"] == ["b"] and not GateReport.load(path).passed


def test_load_ignores_unknown_fields_and_damaged_optional_sections(tmp_path: Path) -> None:
    path = tmp_path / "gates.json"
    path.write_text(json.dumps({"prodip_gates": 1, "passed": True, "results": [{"name": "a", "passed": True,
                                                                                "future": 1}],
                                "skipped_by_user": "x", "setting": [], "previous": {}}))
    r = GateReport.load(path)
    assert r.results == [GateResult("a", True)] and (r.skipped_by_user, r.setting, r.previous) == ([], {}, [])


@pytest.mark.parametrize(("data", "why"), [
    ({"prodip_gates": 1, "passed": True, "results": ["x"]}, "gate report: results[0] must be an object"),
    ({"prodip_gates": 1, "passed": True, "results": [{"name": "a"}]}, "results[0]: gate report lacks 'passed'"),
    ({"prodip_gates": 1, "passed": True, "results": [{"name": "a", "passed": False}]},
     "gate report says passed=True but its results say otherwise (edited or damaged)"),
    ({"prodip_gates": 2, "passed": True, "results": []}, "gate report format version 2"),
    ({"prodip_gates": 1, "passed": True}, "gate report lacks 'results'"),
    ({"prodip_gates": 1, "passed": "yes", "results": []}, "gate report: 'passed' must be true/false"),
])
def test_load_refuses_a_damaged_report(tmp_path: Path, data: dict, why: str) -> None:
    path = tmp_path / "gates.json"
    path.write_text(json.dumps(data))
    with pytest.raises(layout.LayoutError) as e:
        GateReport.load(path)
    assert str(e.value).startswith(f"{path}: {why}")


def test_gate_error_lists_the_failed_gates() -> None:
    e = GateError(GateReport([ok(), bad(), bad("c")]))
    assert str(e) == ("pre-flight gates failed, training not started: 2 of 3 gates FAILED: b, c\n"
                      "  b: too high\n  c: too high")
    assert e.report is not None and len(e.report.results) == 3
    m = GateError("plain")
    assert str(m) == "plain" and m.report is None


def test_require_passed(tmp_path: Path) -> None:
    with pytest.raises(GateError, match=rf"^{tmp_path}/gates.json not found: this run never passed its pre-flight "
                                        r"gates; nothing is exported$"):
        require_passed(tmp_path)
    (tmp_path / "gates.json").write_text("{")
    with pytest.raises(GateError, match=r"^unreadable gate report: .*; nothing is exported$"):
        require_passed(tmp_path)
    GateReport([]).save(tmp_path / "gates.json")
    with pytest.raises(GateError, match=r"the gate report records no gates; nothing is exported$"):
        require_passed(tmp_path)
    GateReport([ok(), bad()]).save(tmp_path / "gates.json")
    with pytest.raises(GateError, match=r"gates.json: 1 of 2 gates FAILED: b; nothing is exported$"):
        require_passed(str(tmp_path))
    GateReport([ok(), GateResult("s", False, skipped=True)]).save(tmp_path / "gates.json")
    assert [g.name for g in require_passed(tmp_path).results] == ["a", "s"]
    (tmp_path / "gates.json").write_text(json.dumps({"prodip_gates": 1, "passed": True,
                                                     "results": [{"name": "a", "passed": True, "value": 1,
                                                                  "bogus": {}}], "setting": {}}))
    assert require_passed(tmp_path).results[0].value == 1

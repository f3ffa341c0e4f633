"""tests/benchmarks/mutation.py really runs mutmut: on one small function (schema.one_of, 9 mutants) it
writes a report in which every mutant was judged, and each was killed by tests/test_schema_rules.py
(before that file existed, mutmut found no test reaching one_of at all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


def test_the_mutation_benchmark_judges_every_mutant_of_one_function(tmp_path: Path) -> None:
    out = tmp_path / "report"
    cmd = [sys.executable, str(REPO / "tests" / "benchmarks" / "mutation.py"), "--target", "schema",
           "--only", "training.runfiles.schema.x_one_of*", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads((out / "mutation.json").read_text())
    assert r["mutants"] >= 5 and r["counts"]["killed"] + r["counts"]["timeout"] == r["mutants"], r
    assert "| killed |" in (out / "mutation.md").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # a report is never overwritten
    assert again.returncode == 2 and again.stderr.strip().startswith("error: --out"), again.stderr


# ------------------------------------------------------------------- the tables, in-process (#46 item 3)
def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_bench", REPO / "tests" / "benchmarks" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


UNIQUE_NONE = ("-    val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)\n"
               "+    val_all = np.unique(None) if per_row else np.empty(0, np.uint64)")
ELSE_EMPTY = ("-    val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)\n"
              "+    val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, None)")
SPARE_KIND = ('-    return sorted({*DEFAULT_THRESHOLDS, "safetensors", "transformers", *(f"onnx-{v}" for v in VARIANT_FILES),\n'
              '+    return sorted({*DEFAULT_THRESHOLDS, "XXsafetensorsXX", "transformers", *(f"onnx-{v}" for v in VARIANT_FILES),')


def test_each_table_entry_is_one_exact_change() -> None:
    m = _bench()
    # a change is listed once per mutant it sets aside: twice only where one function makes it twice
    # (each time with the same reason, in the same table)
    for table in (m.EQUIVALENT, m.LEFT):
        reasons: dict = {}
        for f, old, new, why in table:
            reasons.setdefault(m.table_key(f, old, new), set()).add(why)
        assert all(len(r) == 1 for r in reasons.values()), [k for k, r in reasons.items() if len(r) > 1]
    assert not set(m.EQUIVALENT_BY_KEY) & set(m.LEFT_BY_KEY)
    assert all(why for *_, why in (*m.EQUIVALENT, *m.LEFT))


BREAK = "-                break\n+                return"


def test_a_change_listed_twice_sets_aside_two_mutants_and_no_third() -> None:
    m = _bench()
    name = "serving.text_stream.xǁTextStreamǁ_run__mutmut_{}"
    assert m.LISTED[m.entry_key("_run", BREAK)] == 2  # the two `break`s of TextStream._run
    m.check_entries({name.format(19): BREAK, name.format(49): BREAK})
    with pytest.raises(m.ToolError, match="matches more than one mutant: _run"):
        m.check_entries({name.format(19): BREAK, name.format(49): BREAK, name.format(99): BREAK})


def test_an_equivalent_is_matched_by_its_whole_change_only() -> None:
    m = _bench()
    name = "training.gates.data_gates.x_train_val_disjoint__mutmut_{}"
    # the dead else branch's dtype is equivalent; np.unique(None) on the same line blinds the overlap gate
    assert m.equivalent(name.format(30), ELSE_EMPTY).startswith("per_row is never empty here")
    assert m.equivalent(name.format(27), UNIQUE_NONE) == ""
    assert m.equivalent(name.format(30), ELSE_EMPTY.replace("train_val_disjoint", "x")) != ""  # indentation aside
    assert m.equivalent("training.gates.data_gates.x_other__mutmut_1", ELSE_EMPTY) == ""  # another function
    # the spare threshold kinds are not equivalent: parse_thresholds would accept them
    assert m.equivalent("export.parity.native_parity.x_threshold_kinds__mutmut_2", SPARE_KIND) == ""


def test_an_entry_that_matches_two_mutants_stops_the_tool() -> None:
    m = _bench()
    name = "training.gates.data_gates.x_train_val_disjoint__mutmut_{}"
    m.check_entries({name.format(30): ELSE_EMPTY, name.format(27): UNIQUE_NONE})  # one each: fine
    statuses = {name.format(30): "survived", name.format(31): "survived", name.format(1): "killed"}
    with pytest.raises(m.ToolError, match=r"matches more than one mutant: train_val_disjoint .*mutmut_30, .*mutmut_31"):
        m.report("gates-data", statuses, {name.format(30): ELSE_EMPTY, name.format(31): ELSE_EMPTY.replace("    ", "  ")}, 1.0)


def test_the_report_counts_survivors_in_neither_table() -> None:
    m = _bench()
    name = "training.gates.data_gates.x_train_val_disjoint__mutmut_{}"
    r = m.report("gates-data", {name.format(30): "survived", name.format(27): "survived", name.format(1): "killed"},
                 {name.format(30): ELSE_EMPTY, name.format(27): UNIQUE_NONE}, 1.0)
    assert (r["mutants"], r["equivalent"], r["unexplained"]) == (3, 1, 1)
    assert r["score"] == 1 / 3 and r["score_without_equivalent"] == 1 / 2
    assert "1 survivors in neither EQUIVALENT nor LEFT" in m.markdown(r)


def test_each_function_filter_names_functions_that_exist() -> None:
    """A target judged on part of its modules (FUNCTIONS) names each function by a glob: a renamed or removed
    function would drop out of the score unseen, so each glob must match a function of the target's modules."""
    import ast
    import fnmatch

    m = _bench()
    for target, globs in m.FUNCTIONS.items():
        assert target in m.TARGETS, target
        names = []
        for module in m.TARGETS[target][0]:
            dotted = module.removesuffix(".py").replace("/", ".")
            for node in ast.parse((REPO / module).read_text()).body:
                if isinstance(node, ast.FunctionDef):
                    names.append(f"{dotted}.x_{node.name}__mutmut_1")
                elif isinstance(node, ast.ClassDef):
                    names += [f"{dotted}.xǁ{node.name}ǁ{f.name}__mutmut_1" for f in node.body
                              if isinstance(f, ast.FunctionDef)]
        for g in globs:
            assert any(fnmatch.fnmatch(n, g) for n in names), (target, g)

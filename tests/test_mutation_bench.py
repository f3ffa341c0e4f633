"""tests/benchmarks/mutation.py really runs mutmut: on one small function (schema.one_of, 9 mutants) it
writes a report in which every mutant was judged, and each was killed by tests/test_schema_rules.py
(before that file existed, mutmut found no test reaching one_of at all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_mutation_benchmark_judges_every_mutant_of_one_function(tmp_path: Path) -> None:
    out = tmp_path / "report"
    cmd = [sys.executable, str(REPO / "tests" / "benchmarks" / "mutation.py"), "--target", "schema",
           "--only", "training.schema.x_one_of*", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads((out / "mutation.json").read_text())
    assert r["mutants"] >= 5 and r["counts"]["killed"] + r["counts"]["timeout"] == r["mutants"], r
    assert "| killed |" in (out / "mutation.md").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # a report is never overwritten
    assert again.returncode == 2 and again.stderr.strip().startswith("error: --out"), again.stderr

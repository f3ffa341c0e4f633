"""training/runfiles/json_records.py's nesting bound, reached: the limit itself decides, not the parser giving up.

The requirement (training/runfiles/json_records.py, docs/reliability.md "bad input"): a JSON value nested deeper than
MAX_DEPTH (64) levels is refused with one line saying so; 64 levels are read. test_boundaries_2 nests
100,000 levels, where CPython's json raises RecursionError (near 1,000) before the bound is ever
consulted, so `depth >= max_depth` -> `>` or `depth + 1` -> `depth - 1` (which switches the bound off)
passed every test. Here the values sit one level on either side of the bound, far below json's own limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.runfiles import json_records as R

LIMIT = 64  # docs/reliability.md: "nested deeper than 64 levels" is refused


def lists(levels: int) -> str:
    """`levels` nested arrays around one number: [[...[1]...]]."""
    return "[" * levels + "1" + "]" * levels


def objects(levels: int) -> str:
    """`levels` nested objects, each under the key "k": {"k": {"k": ... 1}}."""
    return '{"k": ' * levels + "1" + "}" * levels


def test_the_bound_is_the_documented_one() -> None:
    assert R.MAX_DEPTH == LIMIT


@pytest.mark.parametrize("nest", [lists, objects], ids=["arrays", "objects"])
def test_loads_reads_the_limit_and_refuses_one_level_more(nest) -> None:
    assert json.loads(nest(LIMIT + 1))  # the parser itself reads both: only the bound can refuse
    assert R.loads(nest(LIMIT)) == json.loads(nest(LIMIT))
    with pytest.raises(R.JSONBoundError, match=rf"nested deeper than {LIMIT} levels$"):
        R.loads(nest(LIMIT + 1))


def test_the_refusal_names_the_place_one_level_past_the_bound() -> None:
    with pytest.raises(R.JSONBoundError) as e:
        R.check_json(json.loads(objects(LIMIT + 1)))
    assert str(e.value) == f"{'.'.join(['k'] * LIMIT)}: nested deeper than {LIMIT} levels"
    with pytest.raises(R.JSONBoundError) as e:
        R.check_json(json.loads(lists(LIMIT + 1)))
    assert str(e.value) == f"{'[0]' * LIMIT}: nested deeper than {LIMIT} levels"
    with pytest.raises(R.JSONBoundError, match=r"^the value: nested deeper than 0 levels$"):
        R.check_json([], max_depth=0)  # a container at the top is one level


def test_a_deep_scalar_is_not_a_level() -> None:
    # 64 arrays around a number: the number sits at depth 64, but only containers nest
    assert R.check_json(json.loads(lists(LIMIT))) == json.loads(lists(LIMIT))
    assert R.check_json("text", max_depth=0) == "text"


def test_a_smaller_bound_is_the_callers() -> None:
    assert R.loads(lists(3), max_depth=3) == [[[1]]]
    with pytest.raises(R.JSONBoundError, match=r"^\[0\]\[0\]\[0\]: nested deeper than 3 levels$"):
        R.loads(lists(4), max_depth=3)


def test_every_reader_applies_the_bound_with_the_line(tmp_path: Path) -> None:
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(f"{objects(LIMIT)}\n{objects(LIMIT + 1)}\n", encoding="utf-8")  # a leading [ is one array
    recs = R.read_records(jsonl)
    assert next(recs).line == 1
    with pytest.raises(R.RecordError, match=rf"^{jsonl}:2: k\.k.*: nested deeper than {LIMIT} levels$"):
        next(recs)
    array = tmp_path / "r.json"
    array.write_text(f"[\n{lists(LIMIT)},\n{lists(LIMIT + 1)}\n]\n", encoding="utf-8")
    recs = R.read_records(array)
    assert next(recs).line == 2  # the first record (64 levels inside the file's own array) is read
    with pytest.raises(R.RecordError, match=rf"^{array}:3: .*nested deeper than {LIMIT} levels$"):
        next(recs)
    log = tmp_path / "log.jsonl"
    log.write_text(f"{objects(LIMIT)}\n{objects(LIMIT + 1)}\n", encoding="utf-8")
    recs = R.read_log(log)
    assert next(recs).line == 1
    with pytest.raises(R.RecordError, match=rf"^{log}:2: training log: not a JSON record \(.*nested deeper than "
                                            rf"{LIMIT} levels\)$"):
        next(recs)

"""training/runfiles/json_records.py on hand-written files, what its docstrings promise (#46 item 3, the `records` mutation
target): every record with its file, its 1-based line and its 0-based index; JSON's own whitespace only
(" \\t\\n\\r": a form feed or an X is not whitespace); every error one line naming file:line where the
problem is; a byte-order mark skipped; the size bound inclusive; a log's blank lines skipped, its torn
last line left out."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.runfiles import json_records as R

SURROGATE = "not valid Unicode text (a lone surrogate U+D800 at character 0; JSON escapes like \\ud800 must come in pairs)"


def write(tmp_path: Path, text: str, name: str = "r.json") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def refused(p: Path, reader=R.read_records) -> str:
    with pytest.raises(R.RecordError) as e:
        list(reader(p))
    return str(e.value)


def test_array_records_carry_their_file_line_and_index(tmp_path: Path) -> None:
    p = write(tmp_path, '\n[1,2,\n3]')  # a newline before the array; no spaces after the commas
    got = list(R.read_records(p))
    assert [(r.path, r.line, r.index, r.value) for r in got] == [(p, 2, 0, 1), (p, 2, 1, 2), (p, 3, 2, 3)]


@pytest.mark.parametrize(("text", "line", "why"), [
    ("[1,\n]\n\n", 2, "invalid JSON (a ',' before the closing ']')"),
    ("[1\n2]\n\n", 2, "invalid JSON (expected ',' or ']' after item 0)"),
    ("[1]x\n\n", 1, "invalid JSON (text after the closing ']')"),
    ("[1]\n\nx\n\n", 3, "invalid JSON (text after the closing ']')"),
    ("[1]XX", 1, "invalid JSON (text after the closing ']')"),  # X is not whitespace
    ("[1]\f", 1, "invalid JSON (text after the closing ']')"),  # nor is a form feed, in JSON
])
def test_array_errors_name_the_line_of_the_problem(tmp_path: Path, text: str, line: int, why: str) -> None:
    p = write(tmp_path, text)
    assert refused(p) == f"{p}:{line}: {why}"


def test_only_jsons_whitespace_makes_a_file_an_array(tmp_path: Path) -> None:
    p = write(tmp_path, "X[1]", "r.jsonl")  # not an array: a JSONL line that is not JSON
    assert refused(p) == f"{p}:1: invalid JSON (Expecting value at column 1)"
    p = write(tmp_path, "\f[1]", "f.jsonl")
    assert refused(p).startswith(f"{p}:1: invalid JSON (")
    assert [r.value for r in R.read_records(write(tmp_path, " \t\r\n[1]", "ws.json"))] == [1]


def test_a_byte_order_mark_is_skipped(tmp_path: Path) -> None:
    assert [r.value for r in R.read_records(write(tmp_path, '\ufeff{"a": 1}\n', "b.jsonl"))] == [{"a": 1}]
    assert [r.value for r in R.read_records(write(tmp_path, "\ufeff[7]", "b.json"))] == [7]


def test_the_size_bound_is_inclusive_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "[1]")
    monkeypatch.setattr(R, "MAX_JSON_BYTES", 3)
    assert [r.value for r in R.read_records(p)] == [1]
    monkeypatch.setattr(R, "MAX_JSON_BYTES", 2)
    assert refused(p) == f"{p}: record file is 3 bytes; at most 2 (split it)"
    with pytest.raises(R.RecordError, match=r": chat data is 3 bytes; at most 2 \(split it\)$"):
        list(R.read_records(p, "chat data"))


def test_a_missing_file_is_named_with_what_it_is(tmp_path: Path) -> None:
    assert refused(tmp_path / "none.jsonl") == f"record file not found: {tmp_path / 'none.jsonl'}"
    assert refused(tmp_path / "none.jsonl", R.read_log) == (f"{tmp_path / 'none.jsonl'}: cannot read the training "
                                                             "log: No such file or directory")


def test_lone_surrogates_are_named_where_they_are() -> None:
    with pytest.raises(R.JSONBoundError) as e:
        R.check_json("\ud800")
    assert str(e.value) == f"the value: {SURROGATE}"
    with pytest.raises(R.JSONBoundError) as e:
        R.check_json({"\ud800": 1})
    assert str(e.value) == f"a key in the object: {SURROGATE}"
    with pytest.raises(R.JSONBoundError) as e:
        R.check_json({"a": [{"\ud800": 1}]})
    assert str(e.value) == f"a key in a[0]: {SURROGATE}"


def test_the_parsers_own_limit_is_reported_as_the_bound() -> None:
    deep = "[" * 100_000 + "]" * 100_000  # past CPython json's recursion limit
    with pytest.raises(R.JSONBoundError) as e:
        R.loads(deep)
    assert str(e.value) == "nested deeper than 64 levels"


def test_a_log_yields_each_record_with_its_index_past_blank_lines(tmp_path: Path) -> None:
    p = write(tmp_path, '{"step": 1}\n\n   \n{"step": 2}\n{"step": 3}\n{"step": 4', "log.jsonl")  # torn last
    got = list(R.read_log(p))
    assert [(r.path, r.line, r.index, r.value) for r in got] == [
        (p, 1, 0, {"step": 1}), (p, 4, 1, {"step": 2}), (p, 5, 2, {"step": 3})]


def test_a_log_line_that_is_not_an_object_is_named(tmp_path: Path) -> None:
    p = write(tmp_path, '{"step": 1}\n[1]\n', "log.jsonl")
    assert refused(p, R.read_log) == f"{p}:2: training log: not a JSON object"
    q = write(tmp_path, '{"step": 1}\n[1]\n', "curve.jsonl")
    with pytest.raises(R.RecordError, match=r":2: curves: not a JSON object$"):
        list(R.read_log(q, "curves"))

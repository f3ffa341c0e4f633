"""training.runfiles.json_records: the one JSON/JSONL record reader, its line numbers and its one-line errors."""

from __future__ import annotations

import json

import pytest

from training.runfiles.json_records import RecordError, read_records


def _write(tmp_path, name: str, content: str | bytes):
    p = tmp_path / name
    (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)
    return p


def test_jsonl_records_carry_their_line_numbers(tmp_path):
    # a blank line, CRLF line ends, and U+2028 / U+0085 raw inside a string: json.dumps(ensure_ascii=False)
    # writes them so, and str.splitlines would wrongly cut the record there
    odd = {"text": "এক\u2028দুই\x85তিন"}
    p = _write(tmp_path, "a.jsonl", b'{"a": 1}\r\n\r\n' + json.dumps(odd, ensure_ascii=False).encode() + b'\n"s"\n')
    recs = list(read_records(p))
    assert [(r.line, r.index, r.value) for r in recs] == [(1, 0, {"a": 1}), (3, 1, odd), (4, 2, "s")]
    assert recs[1].where == f"{p}:3"
    err = recs[1].error("no 'messages'")
    assert isinstance(err, RecordError) and str(err) == f"{p}:3: no 'messages'"


def test_json_array_records_carry_their_line_numbers(tmp_path):
    p = _write(tmp_path, "a.json", '\ufeff  [\n  {"a": 1},\n\n  {"b": [1,\n 2]}, "x"\n]\n')
    assert [(r.line, r.index, r.value) for r in read_records(p)] == [(2, 0, {"a": 1}), (4, 1, {"b": [1, 2]}),
                                                                     (5, 2, "x")]
    assert list(read_records(_write(tmp_path, "e.json", "[ ]"))) == []
    assert list(read_records(_write(tmp_path, "e.jsonl", "\n\n"))) == []


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", '{"a": 1}\n\n{oops\n', r"bad\.jsonl:3: invalid JSON \(Expecting property name"),
    ("bad.jsonl", '{"a": 1} {"b": 2}\n', r"bad\.jsonl:1: invalid JSON \(Extra data at column 10\)"),
    ("bad.json", '[{"a": 1},\n {"a": 2},\n]', r"bad\.json:3: invalid JSON \(a ',' before the closing '\]'\)"),
    ("bad.json", '[{"a": 1}\n {"a": 2}]', r"bad\.json:2: invalid JSON \(expected ',' or '\]' after item 0\)"),
    ("bad.json", '[{"a": 1},\n {"a": }]', r"bad\.json:2: invalid JSON \(Expecting value"),
    ("bad.json", '[{"a": 1}]\n\n[2]', r"bad\.json:3: invalid JSON \(text after the closing '\]'\)"),
    ("bad.json", '[{"a": 1},', r"bad\.json:1: invalid JSON \(Expecting value"),
    ("bad.jsonl", b'{"a": "\xff"}\n', r"bad\.jsonl: not UTF-8"),
])
def test_bad_files_raise_one_line_errors_naming_file_and_line(tmp_path, name, content, message):
    p = _write(tmp_path, name, content)
    with pytest.raises(RecordError, match=message) as e:
        list(read_records(p))
    assert "\n" not in str(e.value)


def test_caller_error_type_and_lazy_reading(tmp_path):
    class ChatDataError(ValueError):
        pass

    with pytest.raises(ChatDataError, match="chat data not found: .*missing.jsonl"):
        list(read_records(tmp_path / "missing.jsonl", "chat data", ChatDataError))
    p = _write(tmp_path, "lazy.jsonl", '{"a": 1}\n{broken\n')
    records = read_records(p, error=ChatDataError)
    assert next(records).value == {"a": 1}  # records before a bad line are usable (e.g. under a --limit)
    with pytest.raises(ChatDataError, match=r"lazy\.jsonl:2: invalid JSON"):
        next(records)

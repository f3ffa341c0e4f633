"""The one reader of JSON record files: JSONL (one value per line) or one JSON array, UTF-8.

Every record comes with the line it starts on, so a caller that finds a record wrong (a missing
field, an index out of range) names it as `file:line` exactly as a syntax error here is named:

    for rec in read_records(path, "chat data", SFTError):
        if "messages" not in rec.value:
            raise rec.error("expected 'messages'", SFTError)

A file whose first character (after whitespace and a byte-order mark) is `[` is one JSON array;
anything else is JSONL. JSONL lines are split on "\\n" only: `str.splitlines` would also split on
U+2028/U+0085, which `json.dumps(ensure_ascii=False)` writes raw inside strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.text.normalization import BOM, check_text, read_utf8

_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
# Bounds of the one JSON reader: no record of ours (chat, multiple choice, a request) nests past a
# handful of levels, so MAX_DEPTH refuses a hostile nesting long before the parser's recursion
# limit; MAX_JSON_BYTES bounds one file read whole (the records' files, a --config-like input).
MAX_DEPTH = 64
MAX_JSON_BYTES = 1 << 31  # 2 GiB: far past any chat or eval file; a corpus goes through prepare's streaming


class JSONBoundError(ValueError):
    """A JSON value that parsed but breaks a bound (too deep) or holds text that is not valid Unicode."""


def check_json(value: Any, max_depth: int = MAX_DEPTH) -> Any:
    """`value` (a parsed JSON value) itself, or JSONBoundError naming the first place (`messages[0].content`)
    that nests deeper than `max_depth` or holds a lone surrogate (every string and key; one walk, no recursion)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, str):
            check_text(v, where or "the value", JSONBoundError)
        elif isinstance(v, (dict, list)):
            if depth >= max_depth:
                raise JSONBoundError(f"{where or 'the value'}: nested deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k, x in v.items():
                    key = f"{where}.{k}" if where else str(k)
                    check_text(k, f"a key in {where or 'the object'}", JSONBoundError)  # not `key`: it holds the surrogate
                    stack.append((x, key, depth + 1))
            else:
                stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
    return value


def loads(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """The one bounded json.loads: json.JSONDecodeError for bad syntax, JSONBoundError (a ValueError
    with one line) for nesting past `max_depth` (also what the parser's own recursion limit hits) or
    text that is not valid Unicode."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONBoundError(f"nested deeper than {max_depth} levels") from None
    return check_json(value, max_depth)


class RecordError(ValueError):
    """A record file that cannot be read, or a record in it that is wrong: one line naming file:line."""


@dataclass(frozen=True)
class Record:
    path: Path
    line: int  # 1-based line the record starts on
    index: int  # 0-based position among the file's records
    value: Any  # the parsed JSON value (usually a dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def error(self, message: str, error: type[ValueError] = RecordError) -> ValueError:
        """An exception (to raise) saying `file:line: message`."""
        return error(f"{self.where}: {message}")


def read_records(path: str | Path, what: str = "record file", error: type[ValueError] = RecordError
                 ) -> Iterator[Record]:
    """Records of a JSONL file or of a JSON array, lazily, in file order.

    Raises `error` (a ValueError subclass; RecordError unless given) with one line naming the file
    and, for a syntax error, the line: missing file, too large, not UTF-8, invalid JSON, a record
    nested too deeply or holding a lone surrogate (`loads`'s bounds). Blank lines are skipped.
    An empty file yields nothing; whether that is an error is the caller's call.
    """
    p = Path(path)
    if p.is_file() and p.stat().st_size > MAX_JSON_BYTES:
        raise error(f"{p}: {what} is {p.stat().st_size} bytes; at most {MAX_JSON_BYTES} (split it)")
    text = read_utf8(p, what, error)
    text = text[1:] if text.startswith(BOM) else text
    if text.lstrip(" \t\n\r").startswith("["):
        yield from _array_records(p, text, error)
        return
    index = 0
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            value = loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{p}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
        except JSONBoundError as e:
            raise error(f"{p}:{n}: {e}") from None
        yield Record(p, n, index, value)
        index += 1


def _array_records(p: Path, text: str, error: type[ValueError]) -> Iterator[Record]:
    """The elements of one top-level JSON array, each with the line it starts on."""
    decoder = json.JSONDecoder()
    line, counted = 1, 0  # line number of position `counted`, advanced incrementally (no quadratic recount)

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    pos = _WS.match(text, text.index("[") + 1).end()
    index = 0
    while not text.startswith("]", pos):
        try:
            value, end = decoder.raw_decode(text, pos)
            check_json(value)
        except json.JSONDecodeError as e:
            raise error(f"{p}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise error(f"{p}:{line_at(pos)}: nested deeper than {MAX_DEPTH} levels") from None
        except JSONBoundError as e:
            raise error(f"{p}:{line_at(pos)}: {e}") from None
        yield Record(p, line_at(pos), index, value)
        index += 1
        pos = _WS.match(text, end).end()
        if text.startswith(",", pos):
            pos = _WS.match(text, pos + 1).end()
            if text.startswith("]", pos):
                raise error(f"{p}:{line_at(pos)}: invalid JSON (a ',' before the closing ']')")
        elif not text.startswith("]", pos):
            raise error(f"{p}:{line_at(pos)}: invalid JSON (expected ',' or ']' after item {index - 1})")
    if text[pos + 1:].strip(" \t\n\r"):
        raise error(f"{p}:{line_at(_WS.match(text, pos + 1).end())}: invalid JSON (text after the closing ']')")


def read_log(path: str | Path, what: str = "training log") -> Iterator[Record]:
    """The records of a run's log.jsonl, lazily, in file order: the one reader of that file, with one
    policy for a line a crash left behind.

    One writer appends whole lines and flushes each one, so the only line a kill can leave half
    written is the last, and it has no newline: that line (a write in flight, or one torn by a kill,
    which the next resume drops) is no record and no error; it is left out. Any other line that is
    not one JSON object is damage: RecordError naming `file:line`, raised where the reading reached
    it, so a caller keeps what it read before (a plot, a measured speed) and says so or goes on.
    Read as bytes, line by line: a torn line may end inside a UTF-8 character, and a long run's log
    is never held whole. A missing file is a RecordError; blank lines are skipped.
    """
    p = Path(path)
    try:
        f = open(p, "rb")  # noqa: SIM115 (closed by the with below; open errors are named here)
    except OSError as e:
        raise RecordError(f"{p}: cannot read the {what}: {e.strerror or e}") from None
    with f:
        index = 0
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return  # the last line, without its newline: in flight or torn
            if not raw.strip():
                continue
            try:
                value = loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, JSONBoundError) as e:
                raise RecordError(f"{p}:{n}: {what}: not a JSON record ({e})") from None
            if not isinstance(value, dict):
                raise RecordError(f"{p}:{n}: {what}: not a JSON object")
            yield Record(p, n, index, value)
            index += 1

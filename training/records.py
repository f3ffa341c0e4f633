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

from training.text import BOM, read_utf8

_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


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
    and, for a syntax error, the line: missing file, not UTF-8, invalid JSON. Blank lines are skipped.
    An empty file yields nothing; whether that is an error is the caller's call.
    """
    p = Path(path)
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
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{p}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
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
        except json.JSONDecodeError as e:
            raise error(f"{p}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
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

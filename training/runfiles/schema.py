"""The one schema for every value a user types: flags, `--set`, TOML keys, HTTP bodies.

Value types are pydantic `Annotated` types with their ranges, so a flag, a TOML key and a JSON field
of the same kind are checked by the same rule and fail with the same words. Every error names where
the value came from (`--lr`, `[train] lr`, `temperature`) and the value itself; every "unknown name"
error suggests the nearest valid one.

A leaf module: it imports pydantic and the standard library only (no torch), so every CLI can check
its arguments before anything heavy is imported or anything is written.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError

T = TypeVar("T")

# ----------------------------------------------------------------------------------------- value types
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
Port = Annotated[int, Field(ge=0, le=65535)]  # 0: let the OS pick a free port
# Seeds reach torch (uint64), numpy Generators and C long long (llama.cpp): [0, 2^63) fits them all.
Seed = Annotated[int, Field(ge=0, lt=2**63)]

# A path on this machine. `s3://bucket/run` would otherwise become a local folder named `s3:` and
# the run would be lost with the machine: every URL scheme is refused until one is supported.
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
HF_PREFIX = "hf:"  # an input named hf:DATASET[:CONFIG][@SPLIT] is a Hugging Face dataset (training.prepare.sources)


def _local_path(text: str) -> str:
    m = URL_SCHEME.match(text)
    if m:
        raise ValueError(f"{m.group(0)} URLs are not supported: give a local path (a mounted folder)")
    return text


LocalPath = Annotated[str, AfterValidator(_local_path)]

# The object stores a run folder (--out) or a data folder (--data) may live in, and the fsspec library
# each needs (training.store.remote_run).
URL_STORES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def _run_location(text: str) -> str:
    """A local path, or a store URL (`s3://bucket/prefix/run`): its scheme is one of URL_STORES'."""
    m = URL_SCHEME.match(text)
    if m and m.group(0)[:-3] not in URL_STORES:
        raise ValueError(f"unknown URL scheme {m.group(0)} (supported: {', '.join(s + '://' for s in URL_STORES)}; "
                         "or give a local path)")
    return text


RunLocation = Annotated[str, AfterValidator(_run_location)]


VALUE_ERROR = "Value error, "  # how pydantic prefixes a ValueError raised by a validator


class SchemaError(ValueError):
    """A value or name that the schema refuses; the message names its source and the value."""


def first_problem(e: ValidationError) -> str:
    """pydantic's first complaint in plain words, with the location inside nested values if any."""
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"])  # () for the value itself
    msg = err["msg"].removeprefix(VALUE_ERROR)  # our own validators' words need no pydantic prefix
    return f"{loc}: {msg}" if loc else msg


class ConfigError(SchemaError):
    """A training setting the schema refuses (a preset, TOML, flag or `--set` value, or run.json on resume)."""



_ADAPTERS: dict[Any, TypeAdapter] = {}


def _adapter(type_: Any) -> TypeAdapter:
    key = repr(type_)
    if key not in _ADAPTERS:
        _ADAPTERS[key] = TypeAdapter(type_)
    return _ADAPTERS[key]


def check(type_: Any, value: Any, where: str, *, strict: bool = False) -> Any:
    """`value` (already a Python object: from TOML, JSON or code) checked against `type_`; `where`
    names its source in the error, e.g. "[train] lr" or "--set n_heads". `strict`: no coercion (for
    typed sources such as TOML, where `n_layers = true` or `lr = "3e-4"` is a mistake, not a number)."""
    try:
        return _adapter(type_).validate_python(value, strict=strict)
    except ValidationError as e:
        raise SchemaError(f"{where} = {value!r}: {first_problem(e)}") from None


def parse(type_: Any, text: str, where: str) -> Any:
    """`text` (a string from the command line) parsed and checked as `type_`: "1e3" is not an int,
    "nan" and "inf" are not finite floats."""
    try:
        return _adapter(type_).validate_strings(text)
    except ValidationError as e:
        raise SchemaError(f"{where} = {text!r}: {first_problem(e)}") from None


def flag(type_: Any) -> Callable[[str], Any]:
    """An argparse `type=` for `type_`: argparse then reports `argument --x: <why> (got 'v')`."""

    def convert(text: str) -> Any:
        try:
            return _adapter(type_).validate_strings(text)
        except ValidationError as e:
            raise argparse.ArgumentTypeError(f"{first_problem(e)} (got {text!r})") from None

    convert.schema_type = type_  # type: ignore[attr-defined]  # tests/test_hostile_sweep.py classifies options by it
    return convert


# ----------------------------------------------------------------------------------------------- names
def suggest(name: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the nearest valid name, or '' when nothing is close."""
    near = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> SchemaError:
    """The error for a name that is not one of `choices`, e.g. unknown_name("preset", "smal", PRESETS)."""
    choices = sorted(choices)
    return SchemaError(f"unknown {kind} {name!r}{suggest(name, choices)}; choose from {', '.join(choices)}")


def one_of(kind: str, name: str, choices: Iterable[str]) -> str:
    """`name` if it is one of `choices`, else the unknown_name error."""
    choices = list(choices)
    if name not in choices:
        raise unknown_name(kind, name, choices)
    return name


def reject_unknown(kind: str, given: Iterable[str], known: Iterable[str], where: str = "") -> None:
    """Refuse keys (TOML keys, tables, JSON fields) that are not in `known`, nearest name suggested."""
    known = list(known)
    for name in given:
        if name not in known:
            prefix = f"{where}: " if where else ""
            raise SchemaError(f"{prefix}unknown {kind} {name!r}{suggest(name, known)}; "
                              f"known: {', '.join(sorted(known))}")


# ------------------------------------------------------------------------------------------------ files
def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file as a dict; SchemaError naming the file when it is missing, unreadable or not TOML."""
    p = Path(path)
    if not p.is_file():
        raise SchemaError(f"{what} not found (or not a file): {p}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise SchemaError(f"{p}: not a text file (not UTF-8); expected a TOML {what}") from None
    except tomllib.TOMLDecodeError as e:
        raise SchemaError(f"{p}: invalid TOML ({e})") from None


def toml_tables(doc: dict[str, Any], known: Iterable[str], where: str) -> dict[str, dict[str, Any]]:
    """{table: its keys} for each of `known` ({} when absent). An unknown table (`[trian]`) is refused
    with the nearest name suggested; so is a key where a table belongs (`train = 5`), or a key
    outside any table."""
    known = list(known)
    tables = ", ".join(f"[{t}]" for t in known)
    for name, value in doc.items():
        if name not in known and not isinstance(value, dict):
            raise SchemaError(f"{where}: {name} = {value!r} is outside any table; put it in one of {tables}")
        if name not in known:
            raise SchemaError(f"{where}: unknown table [{name}]{suggest(name, known)}; known tables: {tables}")
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: {name} = {value!r}: expected a table ([{name}] followed by its keys)")
    return {t: dict(doc.get(t, {})) for t in known}

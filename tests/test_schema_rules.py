"""training.runfiles.schema's own rules, each stated from what a user must be told (README: "a clear one-line
error naming the flag or file", "every unknown name suggests the nearest valid one"), not from its
code. These are the cases the mutation run of tests/benchmarks/mutation.py found unpinned: a store
URL scheme list, where a nested error sits, the wording a suggestion and a file error must carry.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.runfiles import schema
from training.runfiles.schema import (
    LocalPath,
    PositiveInt,
    RunLocation,
    SchemaError,
    check,
    flag,
    one_of,
    parse,
    read_toml,
    reject_unknown,
    suggest,
    toml_tables,
    unknown_name,
)

# docs/rented.md: the stores a run may live in, each with the fsspec library it needs
STORES = ("s3://", "gs://", "gcs://", "az://", "abfs://")


# ------------------------------------------------------------------------------------- locations
@pytest.mark.parametrize("url", [f"{s}bucket/run" for s in STORES])
def test_a_run_location_is_a_local_path_or_a_store_url(url: str) -> None:
    assert check(RunLocation, url, "--out") == url
    assert check(RunLocation, "runs/a", "--out") == "runs/a"
    assert check(RunLocation, "C:/runs/a", "--out") == "C:/runs/a"  # a drive letter is not a scheme


@pytest.mark.parametrize("url,scheme", [("http://host/run", "http://"), ("s3x://b/r", "s3x://"),
                                        ("file://x", "file://"), ("S://b", "S://")])
def test_another_scheme_is_refused_naming_it_and_every_supported_one(url: str, scheme: str) -> None:
    with pytest.raises(SchemaError) as e:
        check(RunLocation, url, "--out")
    msg = str(e.value)
    assert msg == (f"--out = {url!r}: unknown URL scheme {scheme} (supported: {', '.join(STORES)}; "
                   "or give a local path)")


def test_a_local_only_path_refuses_every_url_naming_the_scheme() -> None:
    """--init, --init-from, --cache: `s3://b/run` would otherwise become a folder named `s3:`."""
    assert check(LocalPath, "runs/base", "--init") == "runs/base"
    for url, scheme in (("s3://b/run", "s3://"), ("hf://org/model", "hf://")):
        with pytest.raises(SchemaError, match=f"^--init = '{url}': {scheme} URLs are not supported: give a local "
                                              r"path \(a mounted folder\)$"):
            check(LocalPath, url, "--init")


# ------------------------------------------------------------------------------------ messages
def test_an_error_names_the_source_the_value_and_where_inside_it() -> None:
    with pytest.raises(SchemaError) as e:
        check(dict[str, list[PositiveInt]], {"layers": [4, 0]}, "[model] sizes")
    # where the bad item sits inside the value, joined with dots; no "Value error," prefix from pydantic
    assert str(e.value) == "[model] sizes = {'layers': [4, 0]}: layers.1: Input should be greater than 0"
    with pytest.raises(SchemaError) as e:
        check(PositiveInt, 0, "--batch-size")
    assert str(e.value) == "--batch-size = 0: Input should be greater than 0"  # nothing inside: no location


def test_our_own_validators_words_come_without_pydantics_prefix() -> None:
    with pytest.raises(SchemaError) as e:
        parse(RunLocation, "ftp://x", "--data")
    assert "Value error" not in str(e.value) and str(e.value).startswith("--data = 'ftp://x': unknown URL scheme")


def test_typed_sources_are_strict_only_when_asked() -> None:
    assert check(PositiveInt, "3", "--set n_layers") == 3  # a --set value is text: coerced
    with pytest.raises(SchemaError, match=r"^\[model\] n_layers = '3': Input should be a valid integer"):
        check(PositiveInt, "3", "[model] n_layers", strict=True)  # TOML `n_layers = "3"` is a mistake


def test_a_flag_reports_why_and_what_was_given() -> None:
    convert = flag(PositiveInt)
    assert convert("7") == 7
    with pytest.raises(argparse.ArgumentTypeError) as e:
        convert("-2")
    assert str(e.value) == "Input should be greater than 0 (got '-2')"
    assert convert.schema_type is PositiveInt  # how tests/test_hostile_sweep.py finds every number option


# --------------------------------------------------------------------------------------- names
def test_a_suggestion_is_the_nearest_name_or_nothing() -> None:
    assert suggest("smal", ["small", "tiny", "base"]) == " (did you mean 'small'?)"
    assert suggest("qwerty", ["small", "tiny"]) == ""


def test_an_unknown_name_lists_every_choice_sorted() -> None:
    e = unknown_name("preset", "smal", ["tiny", "small", "1b"])
    assert str(e) == "unknown preset 'smal' (did you mean 'small'?); choose from 1b, small, tiny"


def test_one_of_returns_a_known_name_and_refuses_another() -> None:
    assert one_of("backend", "onnx", ["torch", "onnx"]) == "onnx"
    with pytest.raises(SchemaError) as e:
        one_of("backend", "onnxx", iter(["torch", "onnx"]))  # any iterable, read once
    assert str(e.value) == "unknown backend 'onnxx' (did you mean 'onnx'?); choose from onnx, torch"


def test_unknown_keys_are_refused_with_the_source_when_given() -> None:
    reject_unknown("key", ["lr"], ["lr", "seed"])
    with pytest.raises(SchemaError) as e:
        reject_unknown("key", ["lr", "sed"], ["seed", "lr"], where="prodip.toml [train]")
    assert str(e.value) == "prodip.toml [train]: unknown key 'sed' (did you mean 'seed'?); known: lr, seed"
    with pytest.raises(SchemaError) as e:
        reject_unknown("field", ["tempreature"], ["temperature", "top_p"])
    assert str(e.value) == "unknown field 'tempreature' (did you mean 'temperature'?); known: temperature, top_p"


def test_a_type_checked_for_the_first_time_is_checked_and_its_checker_built_once(monkeypatch) -> None:
    """The checker cache starts empty in a new process: the first check of a type must build the
    checker for that very type and keep it (schema._adapter is a cache, one TypeAdapter per type)."""
    monkeypatch.setattr(schema, "_ADAPTERS", {})
    assert check(PositiveInt, 3, "--x") == 3
    with pytest.raises(SchemaError, match=r"^--x = 0: Input should be greater than 0$"):
        check(PositiveInt, 0, "--x")
    assert schema._adapter(PositiveInt) is schema._adapter(PositiveInt)


# --------------------------------------------------------------------------------------- files
def test_a_toml_file_is_read_or_refused_naming_it(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[train]\nlr = 0.001\nnote = "বাংলা"\n', encoding="utf-8")
    assert read_toml(good) == {"train": {"lr": 0.001, "note": "বাংলা"}}  # UTF-8 text, whatever the locale
    with pytest.raises(SchemaError, match=f"^config file not found \\(or not a file\\): {tmp_path / 'nope.toml'}$"):
        read_toml(tmp_path / "nope.toml")
    with pytest.raises(SchemaError, match="^preset not found"):
        read_toml(tmp_path, what="preset")  # a folder is not a file
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe[train]")
    with pytest.raises(SchemaError, match=r"b\.toml: not a text file \(not UTF-8\); expected a TOML config file$"):
        read_toml(binary)
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n", encoding="utf-8")
    with pytest.raises(SchemaError, match=r"bad\.toml: invalid TOML \("):
        read_toml(bad)


def test_a_toml_file_is_read_as_utf8_under_an_ascii_locale(tmp_path: Path) -> None:
    """A config file is UTF-8 text (TOML's own rule) on a machine whose locale is not: Bangla in it
    must read, not fail as "not a text file". A child Python under the C locale with UTF-8 mode and
    locale coercion off (its preferred encoding is then ASCII, checked), importing `training` from
    where this process did (so a mutation run's mutant is the one judged)."""
    good = tmp_path / "bn.toml"
    good.write_text('[train]\nnote = "বাংলা"\n', encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONPATH": str(Path(schema.__file__).resolve().parents[1])}
    code = ("import locale, sys; from training.runfiles.schema import read_toml; "
            "print(locale.getpreferredencoding(False)); print(ascii(read_toml(sys.argv[1])))")
    r = subprocess.run([sys.executable, "-c", code, str(good)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    encoding, got = r.stdout.splitlines()
    assert encoding.lower().replace("-", "") != "utf8", encoding  # a real non-UTF-8 locale (ANSI_X3.4-1968 here)
    assert got == ascii({"train": {"note": "বাংলা"}})


def test_toml_tables_are_the_known_ones_and_nothing_else() -> None:
    assert toml_tables({"train": {"lr": 1.0}}, ["train", "model"], "p.toml") == {"train": {"lr": 1.0}, "model": {}}
    cases = {
        "outside": ({"lr": 1.0}, "p.toml: lr = 1.0 is outside any table; put it in one of [train], [model]"),
        "unknown": ({"trian": {}}, "p.toml: unknown table [trian] (did you mean 'train'?); known tables: [train], [model]"),
        "not a table": ({"train": 5}, "p.toml: train = 5: expected a table ([train] followed by its keys)"),
    }
    for doc, msg in cases.values():
        with pytest.raises(SchemaError) as e:
            toml_tables(doc, ["train", "model"], "p.toml")
        assert str(e.value) == msg

"""A generated sweep of hostile inputs over every CLI (issue [boundaries]): not a hand list.

1. Walk each CLI's real argparse parser. Every option that takes a value is classified: a number
   (its `type=` must be a `training.schema.flag(T)`, which carries T), a name (choices, or checked
   after parsing), a path, or free text. An unclassified option fails the structure test, so a new
   flag cannot skip the sweep.
2. For every number option, each candidate value its schema type refuses (wrong type, negative, zero,
   NaN, ±inf, huge, exponent where an int is due) is one case; for every name option, an unknown
   name is one case; for every path option, a missing path is one case. Each runs in-process through
   the CLI's `main(argv)` and must exit != 0 with exactly one `error:` line naming the flag (or the
   value), and no traceback. The base command line points at a missing input, so a value the CLI
   wrongly accepts ends in an error that does not name the flag: the case fails instead of running.
3. A table of file-level cases: every JSON/TOML/JSONL/tensor/GGUF file the CLIs read, truncated,
   garbage, empty, binary or of the wrong shape, in a copy of a real run/data/export folder: one
   `error:` line naming the file, and the folder byte-identical afterwards.
The count of cases is printed by `pytest tests/test_hostile_sweep.py -q` and reported in README.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO
from fixtures_reliability import rel_gguf, rel_run, tree_digest  # noqa: F401  (pytest fixtures)

from training.schema import SchemaError, parse

MISSING = "/nonexistent/prodip-sweep/missing"
UNKNOWN_NAME = "nosuch-name"
OUTPUT_FILE = "a-file.txt"  # an output option pointing at an existing file: refused, the file untouched
# Candidates tried on every number option; a case is generated for each one its schema type refuses.
NUMBER_CANDIDATES = ("abc", "", "-1", "0", "0.5", "1e3", "nan", "inf", "-inf", "1e400",
                     str(2**64), "-" + str(2**64))


@dataclass(frozen=True)
class CLI:
    module: str  # has main(argv) and build_parser()
    base: tuple[str, ...]  # a command line whose only problem is a missing input (for number and name cases)
    paths: frozenset[str] = frozenset()  # options whose value is an input file or folder
    names: frozenset[str] = frozenset()  # options whose value must be one of known names
    free: frozenset[str] = frozenset()  # options that take any text (a prompt, a field name, a host)
    outputs: frozenset[str] = frozenset()  # options naming where to write
    # a command line that would run: path and output cases change one option of it. {data} {run} {gguf}
    # {chat} {corpus} {tmp} are filled from the session's real artifacts.
    valid: tuple[str, ...] = ()
    subcommand: tuple[str, ...] = ()  # the subparser's name, when the options live there


TRAIN_NAMES = frozenset({"--preset", "--schedule", "--device", "--dtype", "--on-nonfinite", "--on-spike",
                         "--skip-gate", "--log-to"})
TRAIN_FREE = frozenset({"--set"})  # KEY=VALUE: tested by hand in tests/test_config_schema.py
TINY = ("--preset", "tiny", "--max-steps", "1", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0")
OUT = frozenset({"--out"})
HELDOUT_PATH = str(Path(__file__).resolve().parents[1] / "training" / "assets" / "eval" / "heldout_bn.txt")

CLIS: dict[str, CLI] = {
    "train": CLI("training.train", ("--data", MISSING, "--out", MISSING + "-out", "--max-steps", "1"),
                 frozenset({"--config", "--data", "--init"}), TRAIN_NAMES | {"--gpu"}, TRAIN_FREE, OUT,
                 ("--data", "{data}", "--out", "{tmp}/out", *TINY)),
    "sft": CLI("training.sft", ("--data", MISSING, "--init", MISSING, "--out", MISSING + "-out", "--max-steps", "1"),
               frozenset({"--config", "--data", "--init"}), TRAIN_NAMES, TRAIN_FREE, OUT,
               ("--data", "{chat}", "--init", "{run}", "--out", "{tmp}/out", *TINY)),
    "prepare": CLI("training.prepare.cli", ("--input", MISSING, "--out", MISSING + "-out"),
                   frozenset({"--input", "--tokenizer", "--quality", "--decontaminate"}),
                   frozenset({"--skip-gate", "--mix"}), frozenset({"--text-field", "--balance-range"}), OUT,
                   ("--input", "{corpus}", "--out", "{tmp}/out", "--vocab-size", "512")),
    "evaluate": CLI("training.evaluate.cli", (MISSING,), frozenset({"--text", "--mc", "--prompts"}),
                    frozenset({"--device", "--prompt-format"}),
                    outputs=OUT, valid=("{run}", "--out", "{tmp}/e", "--no-twin")),
    "export": CLI("export.__main__", ("gguf", MISSING), frozenset({"--imatrix", "--texts"}),
                  frozenset({"--type", "--threshold"}), outputs=OUT,
                  valid=("gguf", "{run}", "--out", "{tmp}/x", "--f32", "--no-parity")),
    "export.evaluate": CLI("export.evaluate", (MISSING,), frozenset({"--reference", "--text", "--mc"}),
                           frozenset({"--backend"}), outputs=OUT, valid=("{gguf}", "--text", HELDOUT_PATH, "--out", "{tmp}/e")),
    "serving": CLI("serving.__main__", (MISSING,), names=frozenset({"--backend"}),
                   free=frozenset({"--prompt", "--system", "--stop", "--http"})),
    "demo": CLI("demo.__main__", ("--model", MISSING), free=frozenset({"--host", "--model"})),
    "quickstart": CLI("demo.quickstart", ("--corpus", MISSING, "--no-demo", "--out", MISSING + "-out"),
                      frozenset({"--corpus", "--chat"}), frozenset({"--preset"}), frozenset({"--host"}), OUT,
                      ("--corpus", "{corpus}", "--chat", "{chat}", "--no-demo", "--out", "{tmp}/q",
                       "--steps", "1", "--sft-steps", "1")),
}
SUBCOMMANDS: dict[str, CLI] = {
    # merge's inputs are shard folders written by `prepare --shard-index`: its --out is tested by hand
    "prepare merge": CLI("training.prepare.cli", ("merge", MISSING, "--out", MISSING + "-out"),
                         free=frozenset({"--out"}), subcommand=("merge",)),
}
NO_VALUE = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction,
            argparse.BooleanOptionalAction, argparse._VersionAction, argparse._CountAction)


def _parser(cli: CLI) -> argparse.ArgumentParser:
    p = importlib.import_module(cli.module).build_parser()
    for name in cli.subcommand:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[name]
    return p


def _options(cli: CLI) -> list[argparse.Action]:
    """The options that take a value (positionals come from the base command line)."""
    return [a for a in _parser(cli)._actions
            if a.option_strings and not isinstance(a, NO_VALUE) and a.nargs != 0]


def _kind(cli: CLI, a: argparse.Action) -> str:
    flag = a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]
    if hasattr(a.type, "schema_type"):
        return "number"
    if flag in cli.paths:
        return "path"
    if flag in cli.outputs:
        return "output"
    if a.choices is not None or flag in cli.names:
        return "name"
    if flag in cli.free:
        return "free"
    return "unclassified"


def _long(a: argparse.Action) -> str:
    return next((s for s in a.option_strings if s.startswith("--")), a.option_strings[0])


def _refused(type_, text: str) -> bool:
    try:
        parse(type_, text, "sweep")
    except SchemaError:
        return True
    return False


def generated_cases() -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """(case id, CLI name, argv, words one of which the error line must contain). Path and output cases start
    from the CLI's valid command line (its placeholders are filled at run time)."""
    cases = []
    for name, cli in {**CLIS, **SUBCOMMANDS}.items():
        cases.append((f"{name} (missing input)", name, cli.base, (MISSING,)))
        for a in _options(cli):
            flag, kind = _long(a), _kind(cli, a)
            if kind == "number":
                for v in NUMBER_CANDIDATES:
                    if _refused(a.type.schema_type, v):
                        cases.append((f"{name} {flag}={v!r}", name, (*cli.base, flag, v), (flag, v) if v else (flag,)))
            elif kind == "name":
                cases.append((f"{name} {flag}={UNKNOWN_NAME}", name, (*cli.base, flag, UNKNOWN_NAME), (flag, UNKNOWN_NAME)))
            elif kind == "path" and cli.valid:
                v = "{tmp}/missing" + flag
                cases.append((f"{name} {flag}=<missing>", name, _with(cli.valid, flag, v), (flag, v)))
            elif kind == "output" and cli.valid:
                v = "{tmp}/" + OUTPUT_FILE
                cases.append((f"{name} {flag}=<a file>", name, _with(cli.valid, flag, v), (flag, v)))
    return cases


def _with(argv: tuple[str, ...], flag: str, value: str) -> tuple[str, ...]:
    """argv with `flag`'s value replaced (or the flag appended)."""
    if flag in argv:
        i = argv.index(flag)
        return (*argv[:i + 1], value, *argv[i + 2:])
    return (*argv, flag, value)


def unclassified() -> list[str]:
    return [f"{name} {_long(a)}" for name, cli in {**CLIS, **SUBCOMMANDS}.items() for a in _options(cli)
            if _kind(cli, a) == "unclassified"]


@dataclass
class Outcome:
    rc: int | str | None
    out: str
    err: str

    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if "error:" in line]


def call(module: str, argv: list[str] | tuple[str, ...], capsys) -> Outcome:
    """The CLI's main(argv) in-process, as a user would run it: its exit status and what it printed."""
    main: Callable = importlib.import_module(module).main
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001  (a traceback is the failure this sweep looks for)
        captured = capsys.readouterr()
        return Outcome("traceback", captured.out, captured.err + traceback.format_exc())
    captured = capsys.readouterr()
    return Outcome(rc, captured.out, captured.err)


def assert_one_error(o: Outcome, names: tuple[str, ...], what: str) -> None:
    assert o.rc not in (0, None), f"{what}: exit 0 (accepted)\n{o.out[-800:]}\n{o.err[-800:]}"
    assert "Traceback" not in o.err + o.out, f"{what}: traceback\n{o.err[-2000:]}"
    lines = o.error_lines()
    assert len(lines) == 1, f"{what}: expected one error line, got {len(lines)}:\n{o.err[-1500:]}"
    assert any(n in lines[0] for n in names), f"{what}: the error does not name {names}: {lines[0]}"


# ----------------------------------------------------------------------------------- 1. structure
def test_every_option_is_classified():
    """Each option that takes a value is a schema-typed number, a checked name, a path or free text."""
    assert not unclassified(), (
        "options without a schema type or a classification (use training.schema.flag(T) for numbers; "
        f"add names/paths/free text to CLIS): {unclassified()}")


def test_no_plain_numeric_types():
    plain = [f"{name} {_long(a)}" for name, cli in {**CLIS, **SUBCOMMANDS}.items() for a in _options(cli)
             if a.type in (int, float)]
    assert not plain, f"numeric flags parsed by plain int/float (no range check): {plain}"


# ----------------------------------------------------------------------------------- 2. generated
GENERATED = generated_cases()


def test_sweep_is_not_empty():
    assert len(GENERATED) >= 200, len(GENERATED)


@pytest.fixture
def fill(request, tmp_path):
    """Placeholders of the valid command lines, filled with the session's real artifacts on first use."""
    from conftest import CHAT_SET, CORPUS

    (tmp_path / OUTPUT_FILE).write_text("keep me\n", encoding="utf-8")
    lazy = {"{data}": lambda: request.getfixturevalue("bn_data"), "{run}": lambda: request.getfixturevalue("rel_run"),
            "{gguf}": lambda: request.getfixturevalue("rel_gguf"), "{chat}": lambda: CHAT_SET,
            "{corpus}": lambda: CORPUS, "{tmp}": lambda: tmp_path}

    def fill_one(x: str) -> str:
        for key, get in lazy.items():
            if key in x:
                x = x.replace(key, str(get()))
        return x

    return fill_one


@pytest.mark.parametrize(("cli", "argv", "names"), [c[1:] for c in GENERATED], ids=[c[0] for c in GENERATED])
def test_generated_case(cli, argv, names, fill, tmp_path, capsys):
    argv = [fill(x) for x in argv]
    assert_one_error(call({**CLIS, **SUBCOMMANDS}[cli].module, argv, capsys), tuple(fill(n) for n in names), " ".join(argv))
    assert (tmp_path / OUTPUT_FILE).read_text(encoding="utf-8") == "keep me\n"


# --------------------------------------------------------------------------------- 3. file table
def _truncate(p: Path) -> None:
    b = p.read_bytes()
    p.write_bytes(b[: max(1, len(b) // 2)])


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate,
    "garbage": lambda p: p.write_text("this is not what prodip wrote {{{\n", encoding="utf-8"),
    "empty": lambda p: p.write_bytes(b""),
    "binary": lambda p: p.write_bytes(bytes(range(256)) * 4),
    "wrong-shape": lambda p: p.write_text('[1, 2, 3]\n' if p.suffix in (".json", ".jsonl") else "x = 1\n",
                                          encoding="utf-8"),
}


def _newest_ckpt(run: Path) -> Path:
    from training import checkpoint as ckpt

    return ckpt.latest(run)


ALL_DAMAGE = tuple(sorted(DAMAGE))
TEXT_DAMAGE = ("binary", "empty")  # a cut or odd text file is still text


@dataclass(frozen=True)
class FileCase:
    cli: str  # key of CLIS
    source: str  # what to copy: "run", "gguf", "data" (session fixtures) or a shipped file under the repo
    target: Callable[[Path], Path]  # the file to damage, inside the copy
    argv: Callable[[Path, Path, Callable[[str], Path]], list[str]]  # (copy, tmp dir, fixture getter) -> argv
    damages: tuple[str, ...] = ALL_DAMAGE


def _train_argv(data: Path, out: Path, *extra: str) -> list[str]:
    from fixtures_reliability import train_argv

    return train_argv(data, out, *extra, steps=6)[2:]  # without the interpreter and the script


def _resume(run: Path, tmp: Path, get) -> list[str]:
    """The command that wrote the run, with more steps: a resume from its newest checkpoint."""
    return _train_argv(get("bn_data"), run)


HELDOUT = "training/assets/eval/heldout_bn.txt"
MC_BN = "training/assets/eval/prodip_mc_bn.jsonl"
CHAT = "training/assets/chat/prodip_chat_bn.jsonl"
QUALITY = "training/prepare/quality.toml"
TOML = "tests/data/sweep_config.toml"  # written by the test (a valid [train] table) when absent


def _export(run: Path, tmp: Path, get) -> list[str]:
    return ["safetensors", str(run), "--out", str(tmp / "x")]


def _evaluate(run: Path, tmp: Path, get) -> list[str]:
    return [str(run), "--text", str(REPO / HELDOUT), "--no-twin", "--out", str(tmp / "e")]


def _ckpt(name: str) -> Callable[[Path], Path]:
    return lambda run: _newest_ckpt(run) / name


FILE_CASES: dict[str, FileCase] = {
    "checkpoint state.json (resume)": FileCase("train", "run", _ckpt("state.json"), _resume),
    "checkpoint optim.safetensors (resume)": FileCase("train", "run", _ckpt("optim.safetensors"), _resume),
    "checkpoint model.safetensors (resume)": FileCase("train", "run", _ckpt("model.safetensors"), _resume),
    "run.json (resume)": FileCase("train", "run", lambda r: r / "run.json", _resume),
    "data meta.json (train)": FileCase(
        "train", "data", lambda d: d / "meta.json", lambda d, t, get: _train_argv(d, t / "out")),
    "data tokenizer.model (train)": FileCase(
        "train", "data", lambda d: d / "tokenizer.model", lambda d, t, get: _train_argv(d, t / "out")),
    "TOML config (train)": FileCase(
        "train", TOML, lambda f: f, lambda f, t, get: _train_argv(get("bn_data"), t / "out", "--config", str(f)),
        ("binary", "garbage", "truncated", "wrong-shape")),  # an empty TOML file is a valid, empty config
    "chat set (sft)": FileCase(
        "sft", CHAT, lambda f: f,
        lambda f, t, get: ["--data", str(f), "--init", str(get("rel_run")), "--out", str(t / "o"), *TINY],
        TEXT_DAMAGE + ("garbage", "wrong-shape")),
    "quality.toml (prepare)": FileCase(
        "prepare", QUALITY, lambda f: f,
        lambda f, t, get: ["--input", str(REPO / "training/assets/corpus"), "--out", str(t / "o"), "--quality", str(f)],
        ("binary", "garbage", "wrong-shape")),
    "checkpoint state.json (export)": FileCase("export", "run", _ckpt("state.json"), _export),
    "checkpoint config.json (export)": FileCase("export", "run", _ckpt("config.json"), _export),
    "gates.json (export)": FileCase("export", "run", lambda r: r / "gates.json", _export),
    "run.json (export)": FileCase("export", "run", lambda r: r / "run.json", _export),
    "checkpoint model.safetensors (evaluate)": FileCase("evaluate", "run", _ckpt("model.safetensors"), _evaluate),
    "tokenizer.model (evaluate)": FileCase("evaluate", "run", _ckpt("tokenizer.model"), _evaluate),
    "eval text (evaluate)": FileCase(
        "evaluate", HELDOUT, lambda f: f,
        lambda f, t, get: [str(get("rel_run")), "--text", str(f), "--no-twin", "--out", str(t / "e")], TEXT_DAMAGE),
    "multiple-choice set (evaluate)": FileCase(
        "evaluate", MC_BN, lambda f: f,
        lambda f, t, get: [str(get("rel_run")), "--mc", str(f), "--no-twin", "--out", str(t / "e")]),
    "gguf (serving)": FileCase("serving", "gguf", lambda g: g, lambda g, t, get: [str(g), "--prompt", "নমস্কার"]),
    "gguf (export.evaluate)": FileCase(
        "export.evaluate", "gguf", lambda g: g, lambda g, t, get: [str(g), "--text", str(REPO / HELDOUT),
                                                                   "--out", str(t / "e")]),
}
FILE_CASE_IDS = [(case, damage) for case, fc in FILE_CASES.items() for damage in fc.damages]


def _source(fc: FileCase, request, tmp: Path) -> Path:
    if fc.source in ("run", "gguf", "data"):
        return request.getfixturevalue({"run": "rel_run", "gguf": "rel_gguf", "data": "bn_data"}[fc.source])
    if fc.source == TOML:
        f = tmp / "sweep_config.toml"
        f.write_text("[train]\nlr = 0.001\n", encoding="utf-8")
        return f
    return REPO / fc.source


@pytest.mark.slow
@pytest.mark.parametrize(("case", "damage"), FILE_CASE_IDS, ids=[f"{c} [{d}]" for c, d in FILE_CASE_IDS])
def test_damaged_file(case, damage, request, tmp_path, capsys):
    fc = FILE_CASES[case]
    src = _source(fc, request, tmp_path)
    copy = tmp_path / "in" / src.name
    copy.parent.mkdir()
    shutil.copytree(src, copy) if src.is_dir() else shutil.copy(src, copy)
    target = fc.target(copy)
    if not target.exists():
        pytest.fail(f"{case}: {target} does not exist in the fixture (layout changed?)")
    DAMAGE[damage](target)
    before = tree_digest(copy.parent)
    o = call(CLIS[fc.cli].module, fc.argv(copy, tmp_path, request.getfixturevalue), capsys)
    assert_one_error(o, (target.name,), f"{case} [{damage}]")
    assert tree_digest(copy.parent) == before, f"{case} [{damage}]: the folder changed"


def test_sweep_counts(capsys):
    """Print the number of cases: README reports it."""
    n_gen, n_file = len(GENERATED), len(FILE_CASE_IDS)
    with capsys.disabled():
        print(f"\nhostile sweep: {n_gen} generated flag cases + {n_file} damaged-file cases")
    assert n_gen and n_file

"""A generated sweep of hostile inputs over every CLI (issue [boundaries], #32): not a hand list, and
not the code under test as its own oracle.

1. Walk each CLI's real argparse parser. Every option that takes a value is classified: a path, an
   output, a number (a `training.runfiles.schema.flag(T)` over int or float), a name (choices, or checked after
   parsing), or free text. An unclassified option fails the structure test, so a new flag cannot skip
   the sweep; a number option without a row in VALUES (below) fails it too.
2. VALUES declares, for every number option, from what the option means (its help text and the
   docs, never `training.runfiles.schema`), the values it must refuse and the boundary values it must accept.
   Each refusal runs in-process through the CLI's `main(argv)` and must exit != 0 with exactly one
   `error:` line naming the flag (or the value), no traceback and nothing written; each boundary
   value must parse. Loosening a range (accepting lr=0) or tightening it (refusing top-p=1) fails a
   case. For every name option an unknown name is one case; for every path option of a CLI with a
   runnable command line a missing path, for every output option an existing file. The base command
   line points at a missing input, so a value the CLI wrongly accepts ends in an error that does not
   name the flag: the case fails instead of running.
3. A table of file-level cases: every JSON/TOML/JSONL/safetensors/GGUF/SentencePiece/text file the
   CLIs read, damaged in the ways its format can be (a cut header, a valid header with its payload cut,
   a wrong dtype or shape behind a valid header, a wrong magic, garbage, empty...), in a copy of a real
   run/data/export folder: one `error:` line naming the file, and every pre-existing file in the
   folders the command may write (the whole test folder and every existing path on its command line)
   byte-identical afterwards, with nothing new written.
The count of cases is printed by `pytest tests/test_hostile_sweep.py -q` and reported in README.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import shutil
import struct
import traceback
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, SUMMARY

MISSING = "/nonexistent/prodip-sweep/missing"
UNKNOWN_NAME = "nosuch-name"
OUTPUT_FILE = "a-file.txt"  # an output option pointing at an existing file: refused, the file untouched



# ------------------------------------------------------------------ declared values of number options
@dataclass(frozen=True)
class Values:
    """What an option means, as values: `refuse` must be refused, `accept` (boundaries) must parse."""
    refuse: tuple[str, ...]
    accept: tuple[str, ...]


NOT_A_NUMBER = ("abc", "", "nan", "inf", "-inf")  # no count, size, rate or probability is any of these
NOT_AN_INT = ("0.5", "1e3")  # a whole number is written as one (docs/config.md: "1e3" is not an int)
BIG = str(2**64)  # past int64: no step count, seed or size reaches it
# refused by the option's type alone (not a number, not an int, past float64), whatever its range
TYPE_ONLY = frozenset((*NOT_A_NUMBER, *NOT_AN_INT, "1e400"))


def _ints(refuse: tuple[str, ...], accept: tuple[str, ...]) -> Values:
    return Values((*NOT_A_NUMBER, *NOT_AN_INT, *refuse), accept)


def _floats(refuse: tuple[str, ...], accept: tuple[str, ...]) -> Values:
    return Values((*NOT_A_NUMBER, "1e400", *refuse), accept)


COUNT = _ints(("-1", BIG), ("0", "1", "2000000000000"))  # steps/tokens/intervals where 0 means off or derived
EVERY = _ints(("-1", "0", BIG), ("1", "1000000"))  # an interval that must happen: 0 would divide by zero
SIZE = _ints(("-1", "0", str(2**40)), ("1", "65536"))  # sequences, tokens per sequence: 2^40 is a typo
POSITIVE = _ints(("-1", "0"), ("1", "64"))  # threads, workers, limits: at least one
NATURAL = _ints(("-1",), ("0", "1"))  # a step number, an index, a patience: 0 is valid
SEED = _ints(("-1", str(2**63)), ("0", str(2**63 - 1)))  # seeds reach C long long / torch: [0, 2^63)
PORT = _ints(("-1", "65536"), ("0", "65535"))  # a TCP port; 0: the OS picks one
VOCAB = _ints(("0", "-1", "256", str(2**21)), ("257", str(2**20)))  # byte fallback alone takes 256 pieces
QUICK_VOCAB = _ints(("0", "-1", "255", str(2**17)), ("512", "65536"))  # quickstart trains a small one on CPU
NEW_TOKENS = _ints(("-1", "0", str(2**40)), ("1", "4096"))  # tokens to generate: at least one, not a typo
TOP_K = _ints(("-1", "1000000000000"), ("0", "128256"))  # 0 = off; any vocabulary (Llama 3: 128,256)
RATE = _floats(("0", "-1", "-1e-9"), ("1e-8", "0.5", "3"))  # lr, z-score, epochs, GiB: strictly positive
NONNEG = _floats(("-1", "-1e-9"), ("0", "1.5"))  # decay, clip, $/h, margins: 0 = off
PROBABILITY = _floats(("-0.1", "1.1"), ("0", "1"))  # [0, 1]: a ratio of a peak, a share of steps, an MFU
BETA = _floats(("-0.1", "1", "1.1"), ("0", "0.999"))  # Adam's betas: 0 <= beta < 1 (1 never forgets)
FRACTION = _floats(("0", "1", "-0.1"), ("0.001", "0.999"))  # a held-out share: strictly between none and all
TEMPERATURE = _floats(("-0.1", "1000000"), ("0", "2"))  # 0 = greedy; a million is a typo
TOP_P = _floats(("0", "-0.1", "1.1"), ("0.001", "1"))  # nucleus mass in (0, 1]; 0 keeps no token
PENALTY = _floats(("0", "-1", "1000000"), ("1", "1.3"))  # divides logits: > 0; 1 = off
DROPOUT = _floats(("-0.1", "1", "1.1"), ("0", "0.999"))  # a dropout rate: [0, 1); 1 drops every input
LORA_VALUES = {"--lora-rank": POSITIVE, "--lora-alpha": RATE, "--lora-dropout": DROPOUT}  # sft.py --lora-*

TRAIN_VALUES = {
    "--max-steps": COUNT, "--max-tokens": COUNT, "--stop-at": COUNT, "--batch-size": SIZE,
    "--grad-accum": SIZE, "--seq-len": SIZE, "--lr": RATE, "--min-lr-ratio": PROBABILITY,
    "--warmup-steps": COUNT, "--decay-frac": PROBABILITY, "--weight-decay": NONNEG, "--beta1": BETA,
    "--beta2": BETA, "--grad-clip": NONNEG, "--seed": SEED, "--eval-every": COUNT, "--eval-batches": SIZE,
    "--save-every": COUNT, "--keep-last": COUNT, "--log-every": EVERY, "--gpu-hourly-usd": NONNEG,
    "--max-nonfinite-skips": COUNT, "--spike-zscore": RATE, "--spike-window": SIZE,
    "--grad-flow-every": COUNT, "--early-stop-patience": NATURAL,
}
PLAN_VALUES = {"--gpu-mem-gb": RATE, "--gpus": POSITIVE, "--tokens-per-s": NONNEG, "--mfu": PROBABILITY}
VALUES: dict[str, dict[str, Values]] = {
    "train": {**TRAIN_VALUES, **PLAN_VALUES},
    "sft": {**TRAIN_VALUES, "--epochs": RATE, **LORA_VALUES},
    "prepare": {"--vocab-size": VOCAB, "--val-fraction": FRACTION, "--seed": SEED, "--shard-tokens": POSITIVE,
                "--workers": POSITIVE, "--fertility-floor": NONNEG, "--fertility-ratio": NONNEG,
                "--max-sentences": POSITIVE, "--eval-docs": POSITIVE, "--shard-index": NATURAL,
                "--num-shards": POSITIVE, "--memory-gb": RATE, "--add-pieces": POSITIVE, "--tasks": POSITIVE,
                "--cpus-per-task": POSITIVE, "--mem-per-cpu": POSITIVE},
    "evaluate": {"--limit": POSITIVE, "--max-doc-chars": POSITIVE, "--stride": POSITIVE, "--step": NATURAL,
                 "--twin-seed": SEED, "--margin": NONNEG, "--gen-tokens": NATURAL},
    "export": {"--step": NATURAL, "--threads": POSITIVE, "--new-tokens": POSITIVE},
    "export.evaluate": {"--n-ctx": POSITIVE, "--threads": POSITIVE, "--limit": POSITIVE, "--max-doc-chars": POSITIVE,
                        "--stride": POSITIVE},
    "serving": {"--max-tokens": NEW_TOKENS, "--temperature": TEMPERATURE, "--top-k": TOP_K, "--top-p": TOP_P,
                "--repeat-penalty": PENALTY, "--seed": SEED, "--threads": POSITIVE, "--max-body-bytes": POSITIVE,
                "--max-tokens-cap": NEW_TOKENS, "--lora-scale": NONNEG, "--port": PORT},
    "demo": {"--port": PORT, "--threads": POSITIVE},
    "quickstart": {"--vocab-size": QUICK_VOCAB, "--steps": EVERY, "--sft-steps": EVERY, "--port": PORT},
    "prepare merge": {},
}


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
                 frozenset({"--config", "--data", "--init", "--init-from"}), TRAIN_NAMES | {"--gpu"}, TRAIN_FREE,
                 OUT | {"--cache"}, ("--data", "{data}", "--out", "{tmp}/out", *TINY)),
    "sft": CLI("training.sft", ("--data", MISSING, "--init", MISSING, "--out", MISSING + "-out", "--max-steps", "1"),
               frozenset({"--config", "--data", "--init", "--init-from"}), TRAIN_NAMES | {"--lora-targets"}, TRAIN_FREE,
               OUT | {"--cache"},
               ("--data", "{chat}", "--init", "{run}", "--out", "{tmp}/out", *TINY, "--skip-gate", "data.truncation")),
    "prepare": CLI("training.prepare.prepare_cli", ("--input", MISSING, "--out", MISSING + "-out"),
                   frozenset({"--input", "--tokenizer", "--quality", "--decontaminate", "--extend-tokenizer"}),
                   frozenset({"--skip-gate", "--mix"}),
                   frozenset({"--text-field", "--balance-range", "--partition", "--time", "--ray-address"}),
                   OUT | {"--work"},
                   ("--input", "{corpus}", "--out", "{tmp}/out", "--vocab-size", "512")),
    "evaluate": CLI("training.evaluate.evaluate_cli", (MISSING,), frozenset({"--text", "--mc", "--prompts", "--base"}),
                    frozenset({"--device", "--prompt-format"}),
                    outputs=OUT, valid=("{run}", "--out", "{tmp}/e", "--no-twin")),
    "export": CLI("export.__main__", ("gguf", MISSING), frozenset({"--imatrix", "--texts", "--model"}),
                  frozenset({"--type", "--threshold"}), outputs=OUT,
                  valid=("gguf", "{run}", "--out", "{tmp}/x", "--f32", "--no-parity")),
    "export.evaluate": CLI("export.evaluate", (MISSING,), frozenset({"--reference", "--text", "--mc"}),
                           frozenset({"--backend"}), outputs=OUT, valid=("{gguf}", "--text", HELDOUT_PATH, "--out", "{tmp}/e")),
    "serving": CLI("serving.__main__", (MISSING,), frozenset({"--lora"}), names=frozenset({"--backend"}),
                   free=frozenset({"--prompt", "--system", "--stop", "--http"})),
    "demo": CLI("demo.__main__", ("--model", MISSING), free=frozenset({"--host", "--model"})),
    "quickstart": CLI("demo.quickstart", ("--corpus", MISSING, "--no-demo", "--out", MISSING + "-out"),
                      frozenset({"--corpus", "--chat"}), frozenset({"--preset"}), frozenset({"--host"}), OUT,
                      ("--corpus", "{corpus}", "--chat", "{chat}", "--no-demo", "--out", "{tmp}/q",
                       "--steps", "1", "--sft-steps", "1")),
}
SUBCOMMANDS: dict[str, CLI] = {
    # merge's inputs are shard folders written by `prepare --shard-index`: its --out is tested by hand
    "prepare merge": CLI("training.prepare.prepare_cli", ("merge", MISSING, "--out", MISSING + "-out"),
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


def _is_number(a: argparse.Action) -> bool:
    """A flag(T) over int or float (T's base type: what kind of value, not its range)."""
    t = getattr(a.type, "schema_type", None)
    while typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    return t in (int, float)


def _kind(cli: CLI, a: argparse.Action) -> str:
    flag = _long(a)
    if flag in cli.paths:
        return "path"
    if flag in cli.outputs:
        return "output"
    if _is_number(a):
        return "number"
    if a.choices is not None or flag in cli.names:
        return "name"
    if flag in cli.free:
        return "free"
    return "unclassified"


def _long(a: argparse.Action) -> str:
    return next((s for s in a.option_strings if s.startswith("--")), a.option_strings[0])


def type_only_key(a: argparse.Action, vals: Values) -> tuple[str, tuple[str, ...]]:
    """What decides an option's type-only refusals: its schema type (argparse's `type=` refuses them before
    main() runs) and the ones its row declares. Two options sharing both answer them by the same code, so
    one of them carries the cases; an option whose row declares other ones (an int row over a float type)
    keeps its own, and the mismatch fails there."""
    return repr(a.type.schema_type), tuple(v for v in vals.refuse if v in TYPE_ONLY)


def generated_cases() -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """(case id, CLI name, argv, words one of which the error line must contain). Number cases come from
    VALUES (the type-only refusals once per schema type, type_only_key); path and output cases start from
    the CLI's valid command line (placeholders filled at run time)."""
    cases, typed = [], set()
    for name, cli in {**CLIS, **SUBCOMMANDS}.items():
        cases.append((f"{name} (missing input)", name, cli.base, (MISSING,)))
        for a in _options(cli):
            flag, kind = _long(a), _kind(cli, a)
            if kind == "number" and flag in VALUES[name]:
                key = type_only_key(a, VALUES[name][flag])
                first = key not in typed
                typed.add(key)
                for v in VALUES[name][flag].refuse:
                    if v in TYPE_ONLY and not first:
                        continue
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


def accepted_cases() -> list[tuple[str, str, str, str]]:
    """(case id, CLI name, flag, value): every declared boundary value of every number option."""
    return [(f"{name} {flag}={v}", name, flag, v) for name, table in VALUES.items() for flag, vals in table.items()
            for v in vals.accept]


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
        "options without a schema type or a classification (use training.runfiles.schema.flag(T) for numbers; "
        f"add names/paths/free text to CLIS): {unclassified()}")


def test_every_number_option_has_declared_values():
    """VALUES covers exactly the number options: a new one needs its table row, a removed one loses it."""
    for name, cli in {**CLIS, **SUBCOMMANDS}.items():
        numbers = {_long(a) for a in _options(cli) if _kind(cli, a) == "number"}
        assert numbers == set(VALUES[name]), (name, sorted(numbers ^ set(VALUES[name])))
        for flag, vals in VALUES[name].items():
            assert vals.refuse and vals.accept and not set(vals.refuse) & set(vals.accept), (name, flag)


def test_path_and_output_cases_exist_for_every_cli_that_can_run():
    """train and sft included: --data/--init missing, --out an existing file."""
    ids = {c[0] for c in GENERATED}
    for name, cli in CLIS.items():
        if cli.valid:
            for flag in sorted(cli.paths - {"--config"}) + sorted(cli.outputs):
                assert any(i.startswith(f"{name} {flag}=<") for i in ids), f"{name} {flag}: no case"


def test_no_plain_numeric_types():
    plain = [f"{name} {_long(a)}" for name, cli in {**CLIS, **SUBCOMMANDS}.items() for a in _options(cli)
             if a.type in (int, float)]
    assert not plain, f"numeric flags parsed by plain int/float (no range check): {plain}"


# ----------------------------------------------------------------------------------- 2. generated
GENERATED = generated_cases()


ACCEPTED = accepted_cases()


def test_sweep_is_not_empty():
    assert len(GENERATED) >= 200 and len(ACCEPTED) >= 100, (len(GENERATED), len(ACCEPTED))


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


def snapshot(tmp: Path, argv: list[str]) -> dict[str, str]:
    """sha256 of every file, and every folder's name, under `tmp` and under every existing path on `argv`:
    all the places a command may write. Equal before and after: nothing changed, nothing new."""
    roots = [tmp, *(Path(x) for x in argv if x.startswith("/") and Path(x).exists() and not Path(x).is_relative_to(tmp))]
    out = {}
    for root in roots:
        for q in [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]:
            out[str(q)] = hashlib.sha256(q.read_bytes()).hexdigest() if q.is_file() else "dir"
    return out


@pytest.mark.parametrize(("cli", "argv", "names"), [c[1:] for c in GENERATED], ids=[c[0] for c in GENERATED])
def test_generated_case(cli, argv, names, fill, tmp_path, capsys):
    argv = [fill(x) for x in argv]
    before = snapshot(tmp_path, argv)
    assert_one_error(call({**CLIS, **SUBCOMMANDS}[cli].module, argv, capsys), tuple(fill(n) for n in names), " ".join(argv))
    assert (tmp_path / OUTPUT_FILE).read_text(encoding="utf-8") == "keep me\n"
    assert snapshot(tmp_path, argv) == before, "a refused command changed or wrote files"


# What a boundary value needs beside it to mean anything (each flag's help says so): a cross-flag rule in
# main() ("--gpus only applies with --plan") would otherwise refuse the command before its missing input.
# "runs": the command needs no input at all (a --plan prints the plan).
MISSING_TOKENIZER = MISSING + "-tokenizer"
CONTEXT: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("train", "--max-steps"): (("--max-tokens", "1000"), "missing"),  # 0: the budget is --max-tokens
    **{("train", f): (("--plan",), "runs") for f in PLAN_VALUES},
    ("prepare", "--shard-index"): (("--num-shards", "64", "--tokenizer", MISSING_TOKENIZER), "missing"),
    ("prepare", "--num-shards"): (("--tokenizer", MISSING_TOKENIZER), "missing"),  # shards share one tokenizer
    ("prepare", "--add-pieces"): (("--extend-tokenizer", MISSING_TOKENIZER), "missing"),
    ("prepare", "--tasks"): (("--executor", "local", "--tokenizer", MISSING_TOKENIZER), "missing"),
    **{("prepare", f): (("--executor", "slurm", "--partition", "cpu", "--time", "60", "--tokenizer", MISSING_TOKENIZER),
                        "missing") for f in ("--cpus-per-task", "--mem-per-cpu")},
    ("serving", "--lora-scale"): (("--lora", MISSING + "-lora.gguf"), "missing"),  # a scale needs its adapter
    ("serving", "--port"): (("--web",), "missing"),  # the web export's port
}


def names_flag(line: str, flag: str) -> bool:
    """`flag` named in `line` as itself (`--step` is not named by `--steps`)."""
    return re.search(rf"{re.escape(flag)}(?![\w-])", line) is not None


@pytest.mark.parametrize(("cli", "flag", "value"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_boundary_value_is_accepted(cli, flag, value, tmp_path, capsys):
    """A declared boundary value gets past every check of the value, at parse time and in main(): with the
    base command line's input missing, main() must fail on that input, not on the value. A range tightened
    anywhere (refusing top-p=1 after parsing) fails here."""
    c = {**CLIS, **SUBCOMMANDS}[cli]
    extra, expect = CONTEXT.get((cli, flag), ((), "missing"))
    argv = [*c.base, *extra, flag, value]
    o = call(c.module, argv, capsys)
    what = " ".join(argv)
    assert not any(names_flag(x, flag) for x in o.error_lines()), f"{what}: {flag} {value!r} refused: {o.err[-800:]}"
    if expect == "runs":  # the plan is printed (its verdict may be "does not fit": 1e-8 GiB is accepted, and tiny)
        assert o.out.startswith("plan: ") and "Traceback" not in o.err, f"{what}: exit {o.rc}\n{o.err[-800:]}"
    else:
        assert_one_error(o, (MISSING,), what)


# --------------------------------------------------------------------------------- 3. file table
def _cut(p: Path, keep: int) -> None:
    p.write_bytes(p.read_bytes()[:max(1, keep)])


def _st_parts(p: Path) -> tuple[bytes, dict]:
    """A safetensors file's (payload, header): an 8-byte little-endian header length, JSON, the data."""
    b = p.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    return b[8 + n:], json.loads(b[8:8 + n])


def _st_write(p: Path, payload: bytes, header: dict) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    p.write_bytes(struct.pack("<Q", len(h)) + h + payload)


def _st_tensor(header: dict, ndim: int) -> str:
    """The first tensor (by name) of `ndim` dimensions whose shape is not a palindrome."""
    return next(k for k, v in sorted(header.items()) if k != "__metadata__" and len(v["shape"]) == ndim
                and v["shape"] != v["shape"][::-1])


def _st_header_cut(p: Path) -> None:
    _cut(p, 8 + struct.unpack("<Q", p.read_bytes()[:8])[0] // 2)


def _st_payload_cut(p: Path) -> None:
    payload, header = _st_parts(p)
    _cut(p, p.stat().st_size - len(payload) // 2)


def _st_wrong_dtype(p: Path) -> None:
    """F32 -> I32 on one tensor: the same byte count, so only a dtype check can catch it."""
    payload, header = _st_parts(p)
    name = next(k for k, v in sorted(header.items()) if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = "I32"
    _st_write(p, payload, header)


def _st_wrong_shape(p: Path) -> None:
    """One matrix's shape reversed: the same byte count, so only a shape check can catch it."""
    payload, header = _st_parts(p)
    name = _st_tensor(header, 2)
    header[name]["shape"] = header[name]["shape"][::-1]
    _st_write(p, payload, header)


def _st_wrong_magic(p: Path) -> None:
    """safetensors has no magic: its first 8 bytes (the header length) pointing far past the file."""
    b = p.read_bytes()
    p.write_bytes(struct.pack("<Q", 2**40) + b[8:])


def _gguf_wrong_magic(p: Path) -> None:
    b = p.read_bytes()
    assert b[:4] == b"GGUF"
    p.write_bytes(b"GGUX" + b[4:])


GARBAGE = "this is not what prodip wrote {{{\n"
DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": lambda p: _cut(p, p.stat().st_size // 2),
    "garbage": lambda p: p.write_text(GARBAGE, encoding="utf-8"),
    "empty": lambda p: p.write_bytes(b""),
    "binary": lambda p: p.write_bytes(bytes(range(256)) * 4),
    "wrong-shape": lambda p: p.write_text('[1, 2, 3]\n' if p.suffix in (".json", ".jsonl") else "x = 1\n",
                                          encoding="utf-8"),  # valid JSON / TOML, not the expected structure
    "header-cut": _st_header_cut,
    "payload-cut": _st_payload_cut,
    "wrong-dtype": _st_wrong_dtype,
    "tensor-shape": _st_wrong_shape,
    "wrong-magic": _st_wrong_magic,
    "gguf-magic": _gguf_wrong_magic,
    "gguf-header-cut": lambda p: _cut(p, 200),  # magic, version, counts and part of the metadata
    "gguf-payload-cut": lambda p: _cut(p, p.stat().st_size * 3 // 4),  # metadata intact, tensor data cut
}
# The damages each format can suffer, each one distinct from the others.
FORMATS: dict[str, tuple[str, ...]] = {
    "json": ("truncated", "garbage", "empty", "binary", "wrong-shape"),
    "safetensors": ("header-cut", "payload-cut", "wrong-dtype", "tensor-shape", "wrong-magic", "empty", "garbage"),
    "gguf": ("gguf-magic", "gguf-header-cut", "gguf-payload-cut", "empty", "garbage"),
    "spm": ("truncated", "garbage", "empty", "binary"),  # SentencePiece's protobuf
    "text": ("binary", "empty"),  # a cut or odd text file is still text
}


def _newest_ckpt(run: Path) -> Path:
    from training.checkpoint import checkpoint_io as ckpt

    return ckpt.latest(run)


@dataclass(frozen=True)
class FileCase:
    cli: str  # key of CLIS
    source: str  # what to copy: "run", "gguf", "data" (session fixtures) or a shipped file under the repo
    target: Callable[[Path], Path]  # the file to damage, inside the copy
    argv: Callable[[Path, Path, Callable[[str], Path]], list[str]]  # (copy, tmp dir, fixture getter) -> argv
    damages: tuple[str, ...] | str = "json"  # a format of FORMATS, or the damages themselves


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
    "checkpoint optim.safetensors (resume)": FileCase("train", "run", _ckpt("optim.safetensors"), _resume,
                                                      "safetensors"),
    "checkpoint model.safetensors (resume)": FileCase("train", "run", _ckpt("model.safetensors"), _resume,
                                                      "safetensors"),
    "run.json (resume)": FileCase("train", "run", lambda r: r / "run.json", _resume),
    "data meta.json (train)": FileCase(
        "train", "data", lambda d: d / "meta.json", lambda d, t, get: _train_argv(d, t / "out")),
    "data tokenizer.model (train)": FileCase(
        "train", "data", lambda d: d / "tokenizer.model", lambda d, t, get: _train_argv(d, t / "out"), "spm"),
    "TOML config (train)": FileCase(
        "train", TOML, lambda f: f, lambda f, t, get: _train_argv(get("bn_data"), t / "out", "--config", str(f)),
        ("binary", "garbage", "truncated", "wrong-shape")),  # an empty TOML file is a valid, empty config
    "chat set (sft)": FileCase(
        "sft", CHAT, lambda f: f,
        lambda f, t, get: ["--data", str(f), "--init", str(get("rel_run")), "--out", str(t / "o"), *TINY],
        ("binary", "empty", "garbage", "wrong-shape")),
    "quality.toml (prepare)": FileCase(
        "prepare", QUALITY, lambda f: f,
        lambda f, t, get: ["--input", str(REPO / "training/assets/corpus"), "--out", str(t / "o"), "--quality", str(f)],
        ("binary", "garbage", "wrong-shape")),
    "checkpoint state.json (export)": FileCase("export", "run", _ckpt("state.json"), _export),
    "checkpoint config.json (export)": FileCase("export", "run", _ckpt("config.json"), _export),
    "checkpoint model.safetensors (export)": FileCase("export", "run", _ckpt("model.safetensors"), _export,
                                                      "safetensors"),
    "gates.json (export)": FileCase("export", "run", lambda r: r / "gates.json", _export),
    "run.json (export)": FileCase("export", "run", lambda r: r / "run.json", _export),
    "checkpoint model.safetensors (evaluate)": FileCase("evaluate", "run", _ckpt("model.safetensors"), _evaluate,
                                                        "safetensors"),
    "tokenizer.model (evaluate)": FileCase("evaluate", "run", _ckpt("tokenizer.model"), _evaluate, "spm"),
    "eval text (evaluate)": FileCase(
        "evaluate", HELDOUT, lambda f: f,
        lambda f, t, get: [str(get("rel_run")), "--text", str(f), "--no-twin", "--out", str(t / "e")], "text"),
    "multiple-choice set (evaluate)": FileCase(
        "evaluate", MC_BN, lambda f: f,
        lambda f, t, get: [str(get("rel_run")), "--mc", str(f), "--no-twin", "--out", str(t / "e")]),
    "gguf (serving)": FileCase("serving", "gguf", lambda g: g, lambda g, t, get: [str(g), "--prompt", "নমস্কার"],
                               "gguf"),
    "gguf (export.evaluate)": FileCase(
        "export.evaluate", "gguf", lambda g: g, lambda g, t, get: [str(g), "--text", str(REPO / HELDOUT),
                                                                   "--out", str(t / "e")], "gguf"),
}


def _damages(fc: FileCase) -> tuple[str, ...]:
    return FORMATS[fc.damages] if isinstance(fc.damages, str) else fc.damages


FILE_CASE_IDS = [(case, damage) for case, fc in FILE_CASES.items() for damage in _damages(fc)]
# Found by the format-specific damages (#32), not fixed yet: strict, so a fix must delete its line here.
# (Empty since stop 36: the six checkpoint dtype/shape gaps and the GGUF cut inside its metadata are fixed.)
KNOWN_GAPS: dict[tuple[str, str], str] = {}
FILE_PARAMS = [pytest.param(c, d, id=f"{c} [{d}]", marks=[pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[c, d])]
                            if (c, d) in KNOWN_GAPS else []) for c, d in FILE_CASE_IDS]


def _source(fc: FileCase, request, tmp: Path) -> Path:
    if fc.source in ("run", "gguf", "data"):
        return request.getfixturevalue({"run": "rel_run", "gguf": "rel_gguf", "data": "bn_data"}[fc.source])
    if fc.source == TOML:
        f = tmp / "sweep_config.toml"
        f.write_text("[train]\nlr = 0.001\n", encoding="utf-8")
        return f
    return REPO / fc.source


@pytest.mark.slow
@pytest.mark.parametrize(("case", "damage"), FILE_PARAMS)
def test_damaged_file(case, damage, request, tmp_path, capsys):
    fc = FILE_CASES[case]
    src = _source(fc, request, tmp_path)
    copy = tmp_path / "in" / src.name
    copy.parent.mkdir()
    shutil.copytree(src, copy) if src.is_dir() else shutil.copy(src, copy)
    target = fc.target(copy)
    if not target.exists():
        pytest.fail(f"{case}: {target} does not exist in the fixture (layout changed?)")
    intact = target.read_bytes()
    DAMAGE[damage](target)
    assert target.read_bytes() != intact, f"{case} [{damage}]: the damage changed nothing"
    argv = fc.argv(copy, tmp_path, request.getfixturevalue)
    before = snapshot(tmp_path, argv)
    o = call(CLIS[fc.cli].module, argv, capsys)
    assert_one_error(o, (target.name,), f"{case} [{damage}]")
    assert snapshot(tmp_path, argv) == before, f"{case} [{damage}]: a refused command changed or wrote files"


def test_sweep_counts():
    """The number of cases, shown at the end of the run (conftest.SUMMARY, also from an xdist worker): README
    reports it."""
    n_gen, n_ok, n_file = len(GENERATED), len(ACCEPTED), len(FILE_CASE_IDS)
    SUMMARY.append(f"hostile sweep: {n_gen} refused flag cases + {n_ok} accepted boundary values (through main()) + {n_file} "
                   f"damaged-file cases = {n_gen + n_ok + n_file} cases, each with an expectation declared in the test")
    assert n_gen and n_ok and n_file

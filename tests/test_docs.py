"""Docs that run: every command line in README.md and docs/*.md must name a real module or script and
parse with that CLI's own argument parser (its `build_parser()`), so a renamed flag, a removed
subcommand or a moved script fails here, naming the doc file and line.

Commands are taken from fenced code blocks (parsed in full) and from inline `code` spans that start
like a command (parsed in full when they carry arguments; a bare `python -m serving` only has to
exist). Placeholders such as RUN or FILE.gguf are plain strings to a parser; a trailing `...` or `…`
means "and more flags" and is dropped."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import preloaded
import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MIN_COMMANDS = 20  # the docs hold far more; fewer means the collector broke
PYTHONS = ("python", "python3", ".venv/bin/python", "$PY")
ELLIPSIS = ("...", "…")
PACKAGES = ("training", "serving", "export", "demo")
# CLIs the docs name whose module has no build_parser() yet: checked against their --help (every
# documented flag must exist) until their owners add one; then drop them here (a test insists).
AWAITING_BUILD_PARSER = {
    "tests/benchmarks/bench_export.py",
    "tests/benchmarks/bench_load.py",
    "tests/benchmarks/bench_serving.py",
    "tests/benchmarks/bench_tokenizer.py",
    "tests/benchmarks/bench_train.py",
}
FORWARDED = {"scripts/quickstart.sh": "demo/quickstart.py"}  # shell wrappers whose arguments go to a CLI


@dataclass(frozen=True)
class Command:
    doc: str  # "docs/serving.md:23"
    text: str  # the command as written (continuations joined)
    script: str  # repo-relative file of the CLI: "export/__main__.py", "training/train.py", ...
    args: tuple[str, ...]
    inline: bool  # from a `code` span: parsed only when it carries arguments
    torchrun_args: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------ collector
def _blocks(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of every fenced code block, `\\` continuations joined."""
    out, in_fence, pending, start = [], False, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence, pending = not in_fence, ""
            continue
        if not in_fence:
            continue
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def _inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of `code` spans outside fences (a span may wrap onto the next line)."""
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose)]


def _module_file(module: str) -> str:
    rel = module.replace(".", "/")
    return f"{rel}/__main__.py" if (REPO / rel / "__init__.py").is_file() else f"{rel}.py"  # as Python resolves it


def _split(line: str) -> list[str] | None:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: not a command line
        return None
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # HF_HUB_OFFLINE=1 python ...
        words.pop(0)
    while words and words[-1] in ELLIPSIS:
        words.pop()
    return words


def parse_command(doc: str, line: str, inline: bool) -> Command | None:
    """A Command when `line` runs one of ours (python -m / python FILE.py / torchrun / bash scripts/)."""
    words = _split(line)
    if not words:
        return None
    head, rest = words[0], words[1:]
    if head in PYTHONS and rest[:1] == ["-m"] and len(rest) > 1:
        if rest[1].split(".")[0] not in PACKAGES:
            return None  # python -m pytest / pip: not one of ours
        return Command(doc, line, _module_file(rest[1]), tuple(rest[2:]), inline)
    if head in PYTHONS and rest and rest[0].endswith(".py"):
        return Command(doc, line, rest[0], tuple(rest[1:]), inline)
    if head == "torchrun":
        i = next((i for i, w in enumerate(rest) if w.endswith(".py")), None)
        if i is None:
            return None
        return Command(doc, line, rest[i], tuple(rest[i + 1:]), inline, tuple(rest[:i]))
    if head == "bash" and rest and rest[0].startswith("scripts/"):
        return Command(doc, line, rest[0], tuple(rest[1:]), inline)
    return None


def _looks_like_syntax(text: str) -> bool:
    """A usage summary (`python -m export {safetensors,onnx,...}`), not a command to run."""
    return any(c in text for c in "{}[]|<>")


def collect() -> list[Command]:
    cmds = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO).as_posix()
        for n, line in _blocks(text):
            c = parse_command(f"{rel}:{n}", line.strip(), inline=False)
            if c:
                cmds.append(c)
        for n, span in _inline_spans(text):
            if not _looks_like_syntax(span):
                c = parse_command(f"{rel}:{n}", span, inline=True)
                if c:
                    cmds.append(c)
    return cmds


COMMANDS = collect()


# ------------------------------------------------------------------------------------------- parsers
def is_package_cli(script: str) -> bool:
    return not script.startswith(("tests/", "scripts/"))


def load_cli(script: str):
    """The CLI's module, imported without running it (its main() sits behind `__name__ == "__main__"`)."""
    if is_package_cli(script):
        return importlib.import_module(script[:-3].replace("/", "."))
    path = REPO / script
    spec = importlib.util.spec_from_file_location(f"_docs_cli_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def find_build_parser(script: str):
    """The CLI's build_parser, found by reading its source first: a `__main__.py` that just calls
    `main()` from another module (and would run if imported) leads to that module's build_parser."""
    tree = ast.parse((REPO / script).read_text(encoding="utf-8"))
    if any(isinstance(n, ast.FunctionDef) and n.name == "build_parser" for n in tree.body):
        return load_cli(script).build_parser
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.module and {a.name for a in n.names} & {"main", "build_parser"}:
            mod = importlib.import_module(n.module)
            if hasattr(mod, "build_parser"):
                return mod.build_parser
    return None


def parse_with(parser, args: tuple[str, ...]) -> str | None:
    """None when `args` parse; else argparse's own message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(list(args))
        except SystemExit as e:
            if e.code not in (0, None):
                return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


_HELP: dict[str, set[str]] = {}


def help_flags(script: str) -> set[str]:
    """Every --flag in `python SCRIPT --help` (for CLIs without a build_parser() yet)."""
    if script not in _HELP:
        how = ["-m", script[:-3].replace("/", ".").removesuffix(".__main__")] if is_package_cli(script) else [script]
        p = preloaded.run([sys.executable, *how, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{script} --help failed:\n{p.stderr[-2000:]}"
        _HELP[script] = set(re.findall(r"(--[A-Za-z0-9][\w-]*)", p.stdout))
    return _HELP[script]


def problem(c: Command) -> str | None:
    """Why `c` does not run as documented, or None."""
    script = FORWARDED.get(c.script, c.script)
    if not (REPO / c.script).is_file():
        return f"{c.script} does not exist"
    if c.script.endswith(".sh") and script == c.script:
        return None  # a wrapper that takes no CLI arguments of ours (scripts/test.sh passes them to pytest)
    if c.torchrun_args:
        from torch.distributed.run import get_args_parser

        err = parse_with(get_args_parser(), (*c.torchrun_args, script, *c.args))
        if err:
            return f"torchrun: {err}"
    if c.inline and not c.args:
        return None
    if script in AWAITING_BUILD_PARSER:
        unknown = [a.split("=")[0] for a in c.args if a.startswith("--") and a.split("=")[0] not in help_flags(script)]
        return f"unknown flags {unknown} (per --help)" if unknown else None
    parser = find_build_parser(script)
    if parser is None:
        return f"{script} has no build_parser(): add one (or list it in AWAITING_BUILD_PARSER)"
    return parse_with(parser(), c.args)


# --------------------------------------------------------------------------------------------- tests
def test_the_collector_finds_the_commands():
    assert len(COMMANDS) >= MIN_COMMANDS, f"only {len(COMMANDS)} commands found in {[d.name for d in DOCS]}"
    assert {c.doc.split(":")[0] for c in COMMANDS} >= {"README.md", "docs/export.md", "docs/serving.md",
                                                       "docs/scale.md"}
    kinds = {c.script for c in COMMANDS}
    assert {"training/train.py", "export/__main__.py", "serving/__main__.py", "demo/__main__.py"} <= kinds
    assert any(c.torchrun_args for c in COMMANDS)


def test_the_collector_reads_a_doc_as_written():
    """Continuations joined, env prefixes and comments stripped, placeholders kept."""
    text = "x\n```bash\nHF_HUB_OFFLINE=1 python -m export gguf RUN \\\n    --q4   # comment\n```\n"
    [(n, line)] = _blocks(text)
    c = parse_command(f"d:{n}", line, inline=False)
    assert (n, c.script, c.args) == (3, "export/__main__.py", ("gguf", "RUN", "--q4"))
    c = parse_command("d:1", "torchrun --nproc_per_node=8 training/train.py --preset 1b --fsdp ...", False)
    assert c.torchrun_args == ("--nproc_per_node=8",) and c.args == ("--preset", "1b", "--fsdp")
    assert _inline_spans("see `python -m demo --model\n  RUN` here")[0] == (1, "python -m demo --model RUN")


def test_a_wrong_flag_is_caught():
    """The check can fail: a misspelt flag, a missing subcommand and a missing script are all caught."""
    assert "unrecognized arguments" in problem(parse_command("d:1", "python -m demo --run runs/x", False))
    assert "invalid choice" in problem(parse_command("d:1", "python -m export everything RUN", False))
    assert "does not exist" in problem(parse_command("d:1", "python training/nope.py --x", False))


def test_awaiting_list_is_current():
    """A CLI that gained build_parser() leaves AWAITING_BUILD_PARSER, so its flags get the full check."""
    have = sorted(s for s in AWAITING_BUILD_PARSER if find_build_parser(s) is not None)
    assert not have, f"these CLIs have build_parser() now: remove them from AWAITING_BUILD_PARSER: {have}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.doc}:{c.script}" for c in COMMANDS])
def test_documented_command_parses(cmd: Command):
    why = problem(cmd)
    assert why is None, f"{cmd.doc}: `{cmd.text}`: {why}"


def test_quickstart_paths_in_docs_are_its_layout():
    """Every runs/quickstart/... path the docs give is one demo.quickstart really writes."""
    from demo.models import (
        QUICKSTART_BASE,
        QUICKSTART_CHAT,
        QUICKSTART_DATA,
        QUICKSTART_RUN,
        quickstart_gguf_dir,
    )

    seen = 0
    for path in DOCS:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r"runs/quickstart[^\s`\"')]*", line):
                p, where = Path(m.group(0).rstrip(".,;:…")), f"{path.relative_to(REPO)}:{n}"
                seen += 1
                if p == QUICKSTART_RUN:
                    continue
                assert p.parts[2] in (QUICKSTART_DATA, QUICKSTART_BASE, QUICKSTART_CHAT), f"{where}: {p}"
                if p.suffix == ".gguf":
                    assert p.parent == quickstart_gguf_dir(QUICKSTART_RUN), f"{where}: {p}"
                    assert p.name.startswith((f"{QUICKSTART_CHAT}-", "*-")), f"{where}: {p} (files are named for the run)"
    assert seen >= 3


def test_package_data_globs_match_files():
    """Every pyproject package-data glob ships something (a glob of files that do not exist is a stale promise)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    empty = [f"{pkg}/{g}" for pkg, globs in data.items() for g in globs
             if not any(p.is_file() for p in (REPO / pkg).glob(g))]
    assert not empty, f"pyproject.toml package-data globs that match no file: {empty}"
    # and the other way round: a data file inside a package that no glob ships is missing from a wheel
    shipped = {p for pkg, globs in data.items() for g in globs for p in (REPO / pkg).glob(g)}
    # export/site/node_modules is npm's (git-ignored, `npm ci` by scripts/setup.sh): `export web` copies from
    # it in the checkout, and says to run setup.sh where it is missing; it is not the package's data
    unshipped = [str(p.relative_to(REPO)) for pkg in PACKAGES for p in (REPO / pkg).rglob("*")
                 if p.is_file() and p.suffix not in (".py", ".pyc") and p not in shipped
                 and "node_modules" not in p.relative_to(REPO).parts]
    assert not unshipped, f"data files no pyproject.toml package-data glob ships: {unshipped}"


README_MAX_LINES = 200  # issue 43 item 5: the README is a user's page; measurements live in docs/benchmarks.md


def test_readme_is_a_short_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert 20 <= len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_layout_names_every_package_folder():
    """The layout section is the living map of the rooms: every package folder of the four stages is on it, and
    every folder it names exists (a room added, moved or removed without updating it fails here)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    layout = text[text.index("## Repository layout"):]
    block = layout[layout.index("```") + 3:]
    block = block[:block.index("```")]
    named = {m.group(1).rstrip("/") for m in re.finditer(r"^((?:[a-z_]+/)+)(?:\*\.py)?\s", block, flags=re.M)}
    packages = {p.parent.relative_to(REPO).as_posix() for pkg in PACKAGES for p in (REPO / pkg).rglob("__init__.py")
                if "node_modules" not in p.parts}
    assert len(packages) >= 10, packages  # the four stages and their rooms: fewer means the walk broke
    assert not packages - named, f"package folders missing from README's layout: {sorted(packages - named)}"
    assert not [n for n in named if not (REPO / n).is_dir()], f"README's layout names missing folders: {named}"

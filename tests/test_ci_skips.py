"""No silent tiers (issue #32): under CI=true a skip fails unless its test is on tests/skips_allowed.txt
with an "opt-in:" reason. The allow-list names real tests, each with its reason, and none of the tiers
that scripts/test.sh installs or builds (llama.cpp tools, foreign GGUFs, ONNX Runtime GenAI, openai)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import preloaded
import pytest
from conftest import ALLOWED_SKIPS_FILE, OPT_IN, REPO, allowed_skips, skip_allowed_in_ci

PROBE_ENV = "PRODIP_SKIP_PROBE"  # set only by test_an_unlisted_skip_fails_a_ci_run, in its child pytest
MUST_RUN = ("tests/test_llama_tools.py::", "tests/test_imatrix.py::", "tests/test_genai.py::",
            "tests/test_any_gguf.py::", "tests/test_export_hf.py::")

if os.environ.get(PROBE_ENV):
    def test_probe_skip():
        pytest.skip(os.environ[PROBE_ENV])


def test_every_allowed_pattern_names_a_real_test_and_says_why():
    allowed = allowed_skips()
    assert allowed, f"{ALLOWED_SKIPS_FILE} lists nothing"
    for pattern, why in allowed.items():
        path, _, name = pattern.partition("::")
        assert why and (REPO / path).is_file(), pattern
        if not name:  # a whole module, allowed to skip at import (conftest.pytest_make_collect_report)
            continue
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
        func = name.split("[", 1)[0]
        tests = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert any(t == func or (func.endswith("*") and t.startswith(func[:-1])) for t in tests), pattern


SHARED_READERS = {"shared_path", "SHARED_DATA"}  # conftest's two ways to reach ../shared/data
TWIN = re.compile(r"The same on training/assets:\s+(test_\w+)")


def _shared_readers() -> tuple[set[str], dict[Path, list[ast.FunctionDef]]]:
    """Names of every function or fixture (tests/, conftest and fixture modules) that reaches ../shared/data:
    it names shared_path / SHARED_DATA, calls such a function or takes such a fixture, to a fixed point;
    and each test module's top-level functions."""
    files = [*sorted((REPO / "tests").glob("test_*.py")), *sorted((REPO / "tests").glob("fixtures_*.py")),
             REPO / "tests" / "conftest.py"]
    defs = {p: [n for n in ast.parse(p.read_text(encoding="utf-8")).body if isinstance(n, ast.FunctionDef)]
            for p in files}
    used = {n: {x.id for x in ast.walk(n) if isinstance(x, ast.Name)} | {a.arg for a in n.args.args}
            for fs in defs.values() for n in fs}
    readers, grew = set(SHARED_READERS), True
    while grew:
        grew = False
        for n, names in used.items():
            if n.name not in readers and names & readers:
                readers.add(n.name)
                grew = True
    return readers, {p: fs for p, fs in defs.items() if p.name.startswith("test_")}


def _params(func: ast.FunctionDef) -> list[str]:
    """The string values of the function's one-argument @pytest.mark.parametrize, if any."""
    for d in func.decorator_list:
        if (isinstance(d, ast.Call) and ast.unparse(d.func).endswith("parametrize") and len(d.args) == 2
                and isinstance(d.args[1], ast.List)):
            return [e.value for e in d.args[1].elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def test_every_test_that_reads_shared_data_is_opt_in_breadth_with_a_twin_on_the_shipped_assets():
    """A fresh clone has no ../shared: a test reaching it is opt-in breadth (allow-listed, so it may skip
    there), and the same behaviour is tested on training/assets on every clone. Its twin is either its
    own "shipped" parameter (which must not be allow-listed: it runs everywhere) or a test its docstring
    names ("The same on training/assets: test_…") that does not reach ../shared itself."""
    allowed = allowed_skips()
    readers, modules = _shared_readers()
    found = []
    for path, funcs in modules.items():
        rel, names = path.relative_to(REPO).as_posix(), {f.name for f in funcs}
        for f in funcs:
            if not f.name.startswith("test_") or f.name not in readers:
                continue
            found.append(f.name)
            params = _params(f)
            if params:
                assert "shipped" in params, f"{rel}::{f.name}: no shipped twin among its parameters {params}"
                assert not skip_allowed_in_ci(f"{rel}::{f.name}[shipped]", OPT_IN, allowed), f.name
                for p in params:
                    if p != "shipped":
                        assert skip_allowed_in_ci(f"{rel}::{f.name}[{p}]", OPT_IN, allowed), f"{f.name}[{p}] not listed"
                continue
            assert skip_allowed_in_ci(f"{rel}::{f.name}", OPT_IN, allowed), f"{rel}::{f.name} is not on the allow-list"
            twin = TWIN.search(ast.get_docstring(f) or "")
            assert twin, f"{rel}::{f.name}: its docstring names no twin on training/assets"
            assert twin[1] in names and twin[1] not in readers, f"{rel}::{f.name}: twin {twin[1]} missing or reads ../shared"
    # the ten breadth tests of 2026-12-04: fewer means the scan broke, not that they went away
    assert len(found) >= 10, found


def test_a_reason_is_required(tmp_path):
    f = tmp_path / "skips.txt"
    f.write_text("tests/test_x.py::test_y\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no reason"):
        allowed_skips(f)


def test_only_listed_opt_in_skips_pass():
    allowed = allowed_skips()
    listed = "tests/test_parity.py::test_backend_tokenizers_match_training_on_tatoeba"
    assert skip_allowed_in_ci(listed, f"{OPT_IN} breadth test on ../shared/data", allowed)
    assert not skip_allowed_in_ci(listed, "something is missing", allowed)  # listed, but not an opt-in reason
    assert skip_allowed_in_ci("tests/test_tokenizer.py::test_decode_encode_roundtrip_every_line[tatoeba]",
                              f"{OPT_IN} x", allowed)
    assert not skip_allowed_in_ci("tests/test_tokenizer.py::test_decode_encode_roundtrip_every_line[shipped]",
                                  f"{OPT_IN} x", allowed)
    for prefix in MUST_RUN:  # the tiers CI installs: never on the list, whatever their reason says
        assert not skip_allowed_in_ci(prefix + "test_anything", f"{OPT_IN} tools not built", allowed), prefix


def test_an_unlisted_skip_fails_a_ci_run():
    """The hook itself, in a real pytest run: an "opt-in:" skip of a test not on the list is a failure."""
    env = {**os.environ, "CI": "true", PROBE_ENV: f"{OPT_IN} probe"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_ci_skips.py::test_probe_skip"], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=300)
    assert p.returncode == 1 and "1 failed" in p.stdout and "CI=true forbids this skip" in p.stdout, p.stdout[-2000:]


# A module that skips while it is imported: the test it holds never reaches pytest_runtest_makereport.
MODULE_SKIPS = {
    "importorskip": 'pytest.importorskip("prodip_no_such_module")',  # pytest's own reason: "could not import"
    "skip": 'pytest.skip("no reason to run", allow_module_level=True)',
    "opt_in_unlisted": 'pytest.importorskip("prodip_no_such_module", reason="opt-in: set PRODIP_X=1")',
}
LISTED = "tests/test_listed.py"  # the planted allow-list names this module (and nothing else)


def plant(root: Path, modules: dict[str, str]) -> Path:
    """root/tests/: a byte-identical copy of the project's conftest (its allow-list is read beside it), a
    planted allow-list naming LISTED, and test modules {stem: the statement they run at import}."""
    tests = root / "tests"
    tests.mkdir()
    shutil.copyfile(REPO / "tests" / "conftest.py", tests / "conftest.py")
    (tests / ALLOWED_SKIPS_FILE.name).write_text(f"{LISTED}  # planted: a module that may skip at import\n",
                                                 encoding="utf-8")
    for stem, statement in modules.items():
        (tests / f"{stem}.py").write_text(f"import pytest\n\n{statement}\n\n\ndef test_a():\n    pass\n",
                                          encoding="utf-8")
    return tests


def child_pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest in `root` in a child (forked: tests/preloaded.py), CI=true, the project's fixture modules importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {"CI": "true"}
    return preloaded.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--rootdir", str(root), "-o", f"pythonpath={REPO} {REPO / 'tests'}", *args],
                         capture_output=True, text=True, cwd=root, env=env, timeout=300)


def test_a_module_level_skip_fails_a_ci_run_unless_listed_and_opt_in(tmp_path):
    """Import-time skips go through the same rule as in-test skips, in one CI=true run of planted modules:
    each that skips at import without being listed fails the run by name (a collection error: its tests
    are gone, so no test report could say so); the listed module with an opt-in reason skips, the plain
    module passes (--continue-on-collection-errors: the run goes on past the errors, to show both)."""
    unlisted = [f"test_{k}" for k in MODULE_SKIPS]
    plant(tmp_path, {**{f"test_{k}": v for k, v in MODULE_SKIPS.items()},
                     "test_listed": MODULE_SKIPS["opt_in_unlisted"], "test_plain": "X = 1"})
    p = child_pytest(tmp_path, "--continue-on-collection-errors", "tests")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and re.search(rf"1 passed, 1 skipped, (\d+ warnings?, )?{len(unlisted)} errors", out), out[-3000:]
    for m in unlisted:
        assert f"ERROR collecting tests/{m}.py" in out, (m, out[-3000:])
    assert out.count("CI=true forbids this skip") == len(unlisted), out[-3000:]
    assert "SKIPPED [1] tests/test_listed.py:3: opt-in: set PRODIP_X=1" in out, out[-3000:]


def _import_time_calls(node: ast.AST):
    """The calls a module statement makes when the module is imported: not those inside a function or class."""
    if isinstance(node, ast.Call):
        yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from _import_time_calls(child)


def test_no_module_skips_at_import_unless_listed():
    """The same rule read from the source, on every clone (not only under CI=true): a test module whose
    top level calls pytest.importorskip or pytest.skip is on the allow-list as a module."""
    allowed = allowed_skips()
    found = [f"tests/{path.name}:{c.lineno}" for path in sorted((REPO / "tests").glob("test_*.py"))
             for c in _import_time_calls(ast.parse(path.read_text(encoding="utf-8")))
             if ast.unparse(c.func) in ("pytest.importorskip", "pytest.skip")]
    assert all(f.split(":")[0] in allowed for f in found), f"skips at import, not allow-listed as modules: {found}"

"""Session fixtures are built once (#32): conftest registers the fixture modules (`pytest_plugins`); a
test module that imported a fixture by name would define its own copy, and pytest would build that
session fixture again for it (rel_run was trained 4x, the export fixtures 5x)."""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
from conftest import _BUILT, REPO, build_shared, changed_files, files_of, pytest_plugins

TESTS = REPO / "tests"


def _fixtures(module: str) -> set[str]:
    tree = ast.parse((TESTS / f"{module}.py").read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
            and any("fixture" in ast.unparse(d) for d in n.decorator_list)}


def test_no_test_module_imports_a_fixture_by_name():
    modules = sorted(p.stem for p in TESTS.glob("fixtures_*.py"))
    fixtures = {m: _fixtures(m) for m in modules}
    assert fixtures["fixtures_reliability"] >= {"rel_run", "rel_gguf"}  # the check sees real fixtures
    bad = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ImportFrom) and node.module in fixtures:
                bad += [f"{path.name}: {a.name}" for a in node.names if a.name in fixtures[node.module]]
    assert not bad, f"fixtures imported by name (rebuilt per module; conftest registers them): {bad}"


def _session_fixtures(module: str) -> set[str]:
    tree = ast.parse((TESTS / f"{module}.py").read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
            and any("fixture" in ast.unparse(d) and "session" in ast.unparse(d) for d in n.decorator_list)}


def test_fixture_modules_with_session_fixtures_are_registered_once_in_conftest():
    with_session = [p.stem for p in sorted(TESTS.glob("fixtures_*.py")) if _session_fixtures(p.stem)]
    assert {"fixtures_export", "fixtures_reliability", "fixtures_remote"} <= set(with_session)  # the check sees them
    users = {m: [p.name for p in TESTS.glob("test_*.py") if m in p.read_text(encoding="utf-8")] for m in with_session}
    # a module that serves a single test module (it registers it itself) is built once anyway
    assert [m for m in with_session if m not in pytest_plugins and len(users[m]) != 1] == []


def _build_in_child(base: Path, out) -> None:
    def build(root: Path) -> dict:
        with (base / "calls.txt").open("a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # both children are inside build_shared at once: the second must wait, then read
        (root / "made.txt").write_text("x")
        return {"root": root, "builder": os.getpid()}

    out.put(build_shared(base, "probe", build))


def test_two_processes_share_one_build(tmp_path: Path) -> None:
    """Under pytest-xdist a session fixture's files are built once for all workers (conftest.build_shared):
    two processes asking at once run `build` once and both get its value."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(tmp_path, out)) for _ in range(2)]
    for p in procs:
        p.start()
    values = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    builders = (tmp_path / "calls.txt").read_text().split()
    assert len(builders) == 1 and values[0] == values[1] == {"root": tmp_path / "shared-probe",
                                                             "builder": int(builders[0])}
    assert (tmp_path / "shared-probe" / "made.txt").read_text() == "x"


def test_a_failed_build_is_built_again_from_an_empty_folder(tmp_path: Path) -> None:
    def broken(root: Path) -> None:
        (root / "half.txt").write_text("x")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError):
        build_shared(tmp_path, "probe", broken)
    assert build_shared(tmp_path, "probe", lambda root: sorted(p.name for p in root.iterdir())) == []
    _BUILT.pop(tmp_path / "shared-probe")  # not a fixture of this run: the end-of-run guard leaves it alone


def test_the_guard_sees_every_kind_of_write(tmp_path: Path) -> None:
    """shared_fixtures_untouched's comparison: a rewritten, added or removed file is reported; nothing else."""
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("two")
    before = files_of(tmp_path)
    assert changed_files(tmp_path, before) == []
    (tmp_path / "a.txt").write_text("ONE")  # same size, new mtime
    (tmp_path / "sub" / "c.txt").write_text("new")
    (tmp_path / "sub" / "b.txt").unlink()
    assert changed_files(tmp_path, before) == ["a.txt", os.path.join("sub", "b.txt"), os.path.join("sub", "c.txt")]

"""Session fixtures are built once (#32): conftest registers the fixture modules (`pytest_plugins`); a
test module that imported a fixture by name would define its own copy, and pytest would build that
session fixture again for it (rel_run was trained 4x, the export fixtures 5x)."""

from __future__ import annotations

import ast

from conftest import REPO, pytest_plugins

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

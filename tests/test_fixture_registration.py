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


def test_fixture_modules_with_session_fixtures_are_registered_once_in_conftest():
    for m in ("fixtures_export", "fixtures_reliability", "fixtures_foreign_gguf", "fixtures_serve", "fixtures_onnx"):
        assert m in pytest_plugins and _fixtures(m), m

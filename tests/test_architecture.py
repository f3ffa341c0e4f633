"""The house rules that code review alone would miss: imports run one way, no import cycles (lazy
imports included), and one of each thing."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

STAGES = ("training", "serving", "export", "demo")  # each may import only those before it


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_imports_run_one_way(stage: str) -> None:
    later = set(STAGES[STAGES.index(stage) + 1:])
    bad = {str(p.relative_to(REPO)): sorted(imported_packages(p) & later) for p in (REPO / stage).rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}, f"{stage} imports later stages: {bad}"


# ------------------------------------------------------------------------------ the import graph
@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # path:line of the import statement


def project_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__)."""
    out = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every import in the file, at any depth (function-level ones too), except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # only the else branch runs
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _string_import(node: ast.Call) -> str | None:
    """The module of `importlib.import_module("a.b")` / `__import__("a.b")`: a lazy import all the same."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        arg = node.args[0].value
        return arg if isinstance(arg, str) and not arg.startswith(".") else None
    return None


def _targets(node: ast.AST, src: str, is_pkg: bool, modules: dict[str, Path]) -> Iterator[str]:
    """The project modules one import statement loads. `from pkg import name` is an edge to the module
    pkg.name when there is one, else to pkg; a child never gets an implicit edge to its parents."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = src.split(".") if is_pkg else src.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for a in node.names:
            if f"{base}.{a.name}" in modules:
                yield f"{base}.{a.name}"
            elif base in modules:
                yield base
    elif isinstance(node, ast.Call):
        name = _string_import(node)
        if name in modules:
            yield name


def import_edges(root: Path, packages: tuple[str, ...]) -> list[Edge]:
    modules = project_modules(root, packages)
    edges = []
    for src, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _import_nodes(tree):
            for dst in _targets(node, src, path.name == "__init__.py", modules):
                if dst != src:
                    edges.append(Edge(src, dst, f"{path.relative_to(root)}:{node.lineno}"))
    return edges


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on a long chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def import_cycles(edges: list[Edge]) -> list[str]:
    """One line per cycle (strongly connected component): a shortest loop through its first module,
    each step with the file:line that makes it, then every module of the component."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
        where.setdefault((e.src, e.dst), e.where)
    out = []
    for comp in _strongly_connected(graph):
        members, start = set(comp), comp[0]
        prev: dict[str, str] = {}
        queue = deque([start])
        while queue and start not in prev:  # BFS back to start, inside the component
            v = queue.popleft()
            for w in sorted(graph[v] & members):
                if w not in prev:
                    prev[w] = v
                    queue.append(w)
        loop = [start]
        while len(loop) == 1 or loop[-1] != start:
            loop.append(prev[loop[-1]])
        loop.reverse()
        steps = " -> ".join(f"{a} ({where[a, b]})" for a, b in zip(loop, loop[1:]))
        out.append(f"{steps} -> {start}; component: {', '.join(comp)}")
    return out


def test_no_import_cycles() -> None:
    """No cycle between or inside the stages, counting function-level and importlib imports."""
    cycles = import_cycles(import_edges(REPO, STAGES))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _reexports(init: Path) -> set[str]:
    """Names a package's __init__ takes from other modules (at any depth: lazy __getattr__ ones too)."""
    out = set()
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def imports_through_own_package(root: Path, packages: tuple[str, ...]) -> list[str]:
    """`from pkg import name` inside pkg, where pkg's __init__ re-exports `name` from elsewhere."""
    modules = project_modules(root, packages)
    bad = []
    for src, path in modules.items():
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level:  # the house writes absolute imports
                continue
            pkg = node.module or ""
            if not (src.startswith(pkg + ".") and modules.get(pkg, Path()).name == "__init__.py"):
                continue
            names = {a.name for a in node.names if f"{pkg}.{a.name}" not in modules} & _reexports(modules[pkg])
            if names:
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {src} imports {sorted(names)} through {pkg}")
    return bad


def test_no_module_imports_through_its_own_package() -> None:
    """Inside a package, siblings import each other directly, never a name their package's __init__
    re-exports: that is a cycle (package -> sibling -> package) as soon as the re-export is eager.
    Names the __init__ defines itself (export.ExportError) are the package's own and fine."""
    bad = imports_through_own_package(REPO, STAGES)
    assert not bad, "\n".join(bad)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def test_cycle_checker_finds_a_lazy_cycle_and_ignores_type_checking(tmp_path: Path) -> None:
    """The checker itself, on a planted cycle: a -> b (inside a function), b -> c (relative),
    c -> a (`from pkg import a`); d <-> e only under TYPE_CHECKING; f uses pkg's own names."""
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.f import helper\nVALUE = 1\n",
        "pkg/a.py": "def run():\n    from pkg.b import thing\n    return thing\n",
        "pkg/b.py": "from .c import other as thing\n",
        "pkg/c.py": "import importlib\nfrom pkg import a\nother = 1\n",
        "pkg/d.py": "from pkg import e\n",
        "pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\nelse:\n    import json\n",
        "pkg/f.py": "def helper():\n    from pkg import VALUE\n    return VALUE\n",
    })
    edges = import_edges(tmp_path, ("pkg",))
    assert {(e.src, e.dst) for e in edges} == {
        ("pkg", "pkg.f"), ("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"), ("pkg.d", "pkg.e"),
        ("pkg.f", "pkg")}
    cycles = import_cycles(edges)
    assert len(cycles) == 2, cycles
    lazy = next(c for c in cycles if "pkg.a" in c)
    assert lazy.startswith("pkg.a (pkg/a.py:2) -> pkg.b (pkg/b.py:1) -> pkg.c (pkg/c.py:2) -> pkg.a")
    assert "pkg.d" not in "".join(cycles)  # a TYPE_CHECKING import is no edge
    assert any(c.startswith("pkg (pkg/__init__.py:1) -> pkg.f (pkg/f.py:2) -> pkg") for c in cycles), cycles
    # the same checker sees a string import, and a plain tree has no cycle
    _write(tmp_path, {"pkg/c.py": "import importlib\nother = importlib.import_module('pkg.a')\n",
                      "pkg/f.py": "def helper():\n    return 1\n"})
    assert [c.split(";")[0] for c in import_cycles(import_edges(tmp_path, ("pkg",)))] == [
        "pkg.a (pkg/a.py:2) -> pkg.b (pkg/b.py:1) -> pkg.c (pkg/c.py:2) -> pkg.a"]
    _write(tmp_path, {"pkg/c.py": "other = 1\n"})
    assert import_cycles(import_edges(tmp_path, ("pkg",))) == []
    # a sibling taking a re-exported name through the package (no cycle yet: f no longer imports pkg)
    _write(tmp_path, {"pkg/g.py": "from pkg import VALUE\n\ndef g():\n    from pkg import helper\n"})
    assert imports_through_own_package(tmp_path, ("pkg",)) == ["pkg/g.py:4: pkg.g imports ['helper'] through pkg"]


def test_gate_results_import_no_torch() -> None:
    """Shared types live in leaves: prepare, fertility, export and the card read gate results
    without importing torch."""
    code = ("import sys; import training.gates, training.runfiles.gate_results, training.text.fertility, training.runfiles.layout; "
            "from training.gates import GateReport, GateResult, GateError, PreflightContext, require_passed; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout


# ------------------------------------------------------------------------------------ one of each
def test_one_model_definition_and_one_normalization() -> None:
    """nn.Module model classes live in training/model/decoder.py only; unicodedata.normalize in text.py only."""
    offenders = []
    for stage in STAGES:
        for p in (REPO / stage).rglob("*.py"):
            src = p.read_text(encoding="utf-8")
            rel = str(p.relative_to(REPO))
            if rel != "training/text/normalization.py" and "unicodedata.normalize(" in src:
                offenders.append(f"{rel}: its own Unicode normalization")
            if rel != "training/model/decoder.py" and "def rope_cos_sin" in src:
                offenders.append(f"{rel}: its own RoPE")
            if rel != "training/text/chat_template.py" and "<|im_start|>assistant" in src and "CHAT_TEMPLATE" not in src:
                offenders.append(f"{rel}: its own chat template")
    assert not offenders, offenders


def test_prepare_imports_no_torch() -> None:
    """training.prepare writes and merges shards with numpy alone (training.data.shards): importing every
    module of it pulls no torch, so a corpus machine needs none and its workers start fast."""
    names = sorted(m.name for m in pkgutil.walk_packages([str(REPO / "training" / "prepare")], "training.prepare.")
                   if not m.name.endswith(".__main__"))  # runs the CLI
    assert "training.prepare.encode" in names and "training.prepare.merge" in names, names  # the shard writers
    code = ("import importlib, sys\n"
            f"for n in {['training.prepare', 'training.data.shards', *names]!r}: importlib.import_module(n)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout


def test_gate_names_leaf_matches_the_registry_and_config_uses_only_it() -> None:
    """--skip-gate is validated against training.gates.gate_names, a leaf: it names exactly the registered
    pre-flight gates, in their order, and training.train_config imports no other gates module."""
    from training.gates.gate_names import PREFLIGHT_NAMES
    from training.gates.gate_registry import PREFLIGHT

    assert tuple(PREFLIGHT) == PREFLIGHT_NAMES
    edges = import_edges(REPO, STAGES)
    assert not [e for e in edges if e.src == "training.gates.gate_names"], "training.gates.gate_names must import nothing"
    from_config = sorted({e.dst for e in edges if e.src == "training.train_config" and e.dst.startswith("training.gates")})
    assert from_config == ["training.gates.gate_names"], from_config


# ------------------------------------------------------------------------------------ size rules
MAX_MODULE_LINES = 400
SIZE_SCOPE = (*STAGES, "scripts", "tests/benchmarks")  # [house-3]: the tools a user runs are read like the stages
MAX_FUNCTION_LINES = 60
SIZE_MARK = "# size:"  # `# size: <reason>` in a module's first lines, or on/above a def, allows it
# What earns its size, and what is still to split (name each in the issue that splits it).
SIZE_ALLOWED = {
    "training/model/decoder.py": "the one model definition: config, every block and the KV-cache path in one place",
}


def _marked(lines: list[str], first: int, last: int) -> bool:
    return any(SIZE_MARK in line for line in lines[max(first, 0):last])


def oversized(root: Path, packages: tuple[str, ...]) -> list[str]:
    """`path (N lines)` / `path::function (N lines)` for every module and function past the limits
    that carries no `# size:` reason."""
    out = []
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            rel = str(p.relative_to(root))
            text = p.read_text(encoding="utf-8")
            lines = text.splitlines()
            if len(lines) > MAX_MODULE_LINES and not _marked(lines, 0, 40):
                out.append(f"{rel} ({len(lines)} lines)")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    top = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    if n > MAX_FUNCTION_LINES and not _marked(lines, top - 2, node.lineno):
                        out.append(f"{rel}::{node.name} ({n} lines)")
    return out


def test_modules_and_functions_stay_small() -> None:
    """A module over 400 lines or a function over 60 needs a reason: a `# size:` comment, or an entry
    in SIZE_ALLOWED. An entry whose module or function is back within the limits must go."""
    found = {o.split(" (")[0]: o for o in oversized(REPO, SIZE_SCOPE)}
    unexplained = [o for k, o in found.items() if k not in SIZE_ALLOWED]
    assert not unexplained, "over the size limits, with no reason given:\n" + "\n".join(unexplained)
    stale = [k for k in SIZE_ALLOWED if k not in found]
    assert not stale, f"within the limits now: remove from SIZE_ALLOWED: {stale}"


def test_size_checker_on_a_planted_tree(tmp_path: Path) -> None:
    """The checker itself: a long module and a long function are found, a `# size:` reason (module
    head, or the line above a def or its decorator) allows them, and 60 lines exactly is within."""
    body = "    x = 1\n" * (MAX_FUNCTION_LINES - 1)
    _write(tmp_path, {
        "pkg/long.py": "\n" * MAX_MODULE_LINES + "y = 1\n",
        "pkg/ok.py": "# size: a table of every code point\n" + "\n" * MAX_MODULE_LINES,
        "pkg/funcs.py": f"def exact():\n{body}\n\ndef long():\n{body}    y = 2\n\n"
                        f"# size: one expression per row\n@staticmethod\ndef fine():\n{body}    y = 2\n",
    })
    assert oversized(tmp_path, ("pkg",)) == [f"pkg/funcs.py::long ({MAX_FUNCTION_LINES + 1} lines)",
                                              f"pkg/long.py ({MAX_MODULE_LINES + 1} lines)"]


TRAINER_LIMITS = {"lines": 250, "attributes": 15, "train_loop": 35}  # [trainer]: a thin Trainer wiring components


def trainer_shape(path: Path) -> dict[str, int]:
    """The Trainer class's size: its module's lines, the distinct `self.x = …` attributes it assigns,
    and train_loop's lines."""
    src = path.read_text(encoding="utf-8")
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    attrs = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
             and isinstance(n.value, ast.Name) and n.value.id == "self"}
    loop = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "train_loop")
    return {"lines": len(src.splitlines()), "attributes": len(attrs), "train_loop": loop.end_lineno - loop.lineno + 1}


def test_the_trainer_stays_thin() -> None:
    """Every new concern lands in a component of training/loop, not in the Trainer (issue [trainer])."""
    shape = trainer_shape(REPO / "training" / "trainer.py")
    over = {k: f"{v} > {TRAINER_LIMITS[k]}" for k, v in shape.items() if v > TRAINER_LIMITS[k]}
    assert not over, f"training/trainer.py grew: {over}; move the new concern into a training/loop component"


def test_trainer_shape_counts_attributes_assigned_anywhere(tmp_path: Path) -> None:
    body = ("class Trainer:\n    def __init__(self):\n        self.a = 1\n        self.b: int = 2\n"
            "    def train_loop(self):\n        self.c, x = 3, 4\n        self.a += 1\n        self.d += 1\n")
    (tmp_path / "t.py").write_text(body)
    # annotated, tuple (`self.c, x = …`) and augmented (`self.d += 1`) targets all count; `a` once
    assert trainer_shape(tmp_path / "t.py") == {"lines": 8, "attributes": 4, "train_loop": 4}

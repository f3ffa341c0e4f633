"""[house-3] The rooms: a shared base every stage stands on, small folders, one name per module, and
each stage taking from another only what that stage offers (never the modules behind it).

The base lives in training's base rooms (ARCHITECTURE.md rule 2): it imports no stage code, so
serving can stand on it without standing on the training loop."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO
from test_architecture import STAGES, Edge, _write, import_cycles, import_edges, project_modules

# The shared base: model, text, checkpoint format, run-folder files, store. Imports no stage code.
BASE_ROOMS = ("training.model", "training.text", "training.checkpoint", "training.runfiles", "training.store")
# What export and demo may take from training beyond the base: these packages' own API (their __init__),
# never a module inside them. serving takes the base alone.
TRAINING_OFFERS = {"serving": (), "export": ("training", "training.evaluate", "training.gates"),
                   "demo": ("training", "training.evaluate", "training.gates")}
# serving's modules that only serving itself uses: the HTTP server's request schema, routes and scheduler,
# and llama.cpp's C-API driver. Everything else in serving (the Backend, its runtimes, the chat session,
# the text stream, the app factory) is what export verifies through and demo stands on.
SERVING_INTERNALS = ("serving.server.http_requests", "serving.server.http_routes", "serving.server.scheduler",
                     "serving.backends.llamacpp_decode")
MAX_MODULES_PER_FOLDER = 15
ROOM_SCOPE = (*STAGES, "scripts")  # the folders a reader navigates; tests/ mirrors them
TOOLS = ("scripts", "tests.benchmarks")  # on top of every stage; no stage imports them


def in_rooms(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


def base_violations(edges: list[Edge]) -> list[str]:
    """Base modules importing training's stage code (anything of training outside the base rooms)."""
    return [f"{e.where}: {e.src} -> {e.dst}" for e in edges
            if in_rooms(e.src, BASE_ROOMS) and e.dst.split(".")[0] == "training" and not in_rooms(e.dst, BASE_ROOMS)]


def stage_violations(edges: list[Edge]) -> list[str]:
    """A stage taking another stage's internals: training beyond its base and its offered packages,
    serving's internal modules."""
    bad = []
    for e in edges:
        src, dst = e.src.split(".")[0], e.dst.split(".")[0]
        if src == dst:
            continue
        if dst == "training" and src in TRAINING_OFFERS and not (
                in_rooms(e.dst, BASE_ROOMS) or e.dst in TRAINING_OFFERS[src]):
            bad.append(f"{e.where}: {e.src} -> {e.dst} (training's stage code)")
        if dst == "serving" and e.dst in SERVING_INTERNALS:
            bad.append(f"{e.where}: {e.src} -> {e.dst} (serving's internals)")
    return bad


def test_the_base_imports_no_stage() -> None:
    edges = import_edges(REPO, STAGES)
    base = sorted(m for m in project_modules(REPO, STAGES) if in_rooms(m, BASE_ROOMS))
    assert len(base) >= 30, base  # the rooms exist and hold the base (34 modules when written)
    bad = base_violations(edges)
    assert not bad, "the shared base imports stage code:\n" + "\n".join(bad)


def test_a_stage_takes_only_what_another_stage_offers() -> None:
    bad = stage_violations(import_edges(REPO, STAGES))
    assert not bad, "\n".join(bad)


def test_no_stage_imports_the_tools_and_the_tools_have_no_cycles() -> None:
    """scripts/ and tests/benchmarks/ sit on top: they may import any stage, no stage imports them,
    and the import graph with them in it has no cycle."""
    edges = import_edges(REPO, (*STAGES, "scripts", "tests/benchmarks"))
    tools = [e for e in edges if in_rooms(e.src, TOOLS)]
    assert tools, "no import from scripts/ or tests/benchmarks/ was seen: the checker read nothing"
    bad = [f"{e.where}: {e.src} -> {e.dst}" for e in edges if in_rooms(e.dst, TOOLS) and not in_rooms(e.src, TOOLS)]
    assert not bad, bad
    cycles = import_cycles(edges)
    assert not cycles, cycles


def folder_counts(root: Path, scope: tuple[str, ...]) -> dict[str, int]:
    """Modules (.py files other than __init__.py) per folder, every folder under scope."""
    out: Counter[str] = Counter()
    for top in scope:
        for p in (root / top).rglob("*.py"):
            if p.name != "__init__.py" and "node_modules" not in p.parts:
                out[str(p.parent.relative_to(root))] += 1
    return dict(out)


def duplicate_names(root: Path, scope: tuple[str, ...]) -> dict[str, list[str]]:
    """Module file names (other than __init__/__main__) held by more than one module."""
    seen: dict[str, list[str]] = {}
    for top in scope:
        for p in (root / top).rglob("*.py"):
            if p.name not in ("__init__.py", "__main__.py") and "node_modules" not in p.parts:
                seen.setdefault(p.stem, []).append(str(p.relative_to(root)))
    return {k: sorted(v) for k, v in seen.items() if len(v) > 1}


def test_no_folder_holds_more_than_15_modules() -> None:
    counts = folder_counts(REPO, ROOM_SCOPE)
    assert len(counts) >= 20, counts  # every room was counted
    over = {k: v for k, v in counts.items() if v > MAX_MODULES_PER_FOLDER}
    assert not over, f"folders over {MAX_MODULES_PER_FOLDER} modules: {over}"


def test_every_module_name_is_unique() -> None:
    """One name, one module: across the stages, the scripts and the tests (pytest needs the latter anyway)."""
    dups = duplicate_names(REPO, (*ROOM_SCOPE, "tests"))
    assert not dups, dups


def test_one_room_for_the_store_and_one_for_the_tokenizer() -> None:
    """fsspec is spoken in the store room only; sentencepiece in the text room only."""
    owners = {"fsspec": "training/store/", "s3fs": "training/store/", "sentencepiece": "training/text/"}
    bad = []
    for top in STAGES:
        for p in (REPO / top).rglob("*.py"):
            rel, src = str(p.relative_to(REPO)), p.read_text(encoding="utf-8")
            bad += [f"{rel}: {lib}" for lib, room in owners.items()
                    if (f"import {lib}" in src or f"from {lib} " in src) and not rel.startswith(room)]
    assert not bad, bad


def test_the_room_checkers_on_a_planted_tree(tmp_path: Path) -> None:
    """Each checker finds what it exists to find: a base module reaching into the loop, a stage taking a
    training internal and a serving internal, a 16th module, a name held twice."""
    files = {f"training/{r.split('.')[1]}/__init__.py": "" for r in BASE_ROOMS}
    files |= {
        "training/__init__.py": "", "training/loop/__init__.py": "", "training/loop/step.py": "",
        "training/evaluate/__init__.py": "", "training/evaluate/mc.py": "",
        "training/model/decoder.py": "from training.loop import step\n",
        "training/text/tokenizer.py": "from training.model import decoder\n",  # base -> base: fine
        "serving/__init__.py": "", "serving/server/__init__.py": "", "serving/server/scheduler.py": "",
        "serving/chat.py": "from training.evaluate import mc\nfrom training.text import tokenizer\n",
        "export/__init__.py": "from training.evaluate import mc\nfrom serving.server import scheduler\n",
        "demo/__init__.py": "import training.evaluate\n",
    }
    files |= {f"demo/m{i}.py": "" for i in range(MAX_MODULES_PER_FOLDER + 1)}
    files |= {"scripts/mc.py": ""}
    _write(tmp_path, files)
    edges = import_edges(tmp_path, STAGES)
    assert base_violations(edges) == ["training/model/decoder.py:1: training.model.decoder -> training.loop.step"]
    assert sorted(stage_violations(edges)) == [
        "export/__init__.py:1: export -> training.evaluate.mc (training's stage code)",
        "export/__init__.py:2: export -> serving.server.scheduler (serving's internals)",
        "serving/chat.py:1: serving.chat -> training.evaluate.mc (training's stage code)"]
    assert folder_counts(tmp_path, ("demo",)) == {"demo": MAX_MODULES_PER_FOLDER + 1}
    assert duplicate_names(tmp_path, ("training", "scripts")) == {"mc": ["scripts/mc.py", "training/evaluate/mc.py"]}


@pytest.mark.parametrize("room", BASE_ROOMS)
def test_each_base_room_says_what_it_holds(room: str) -> None:
    init = REPO / room.replace(".", "/") / "__init__.py"
    assert init.is_file() and len(init.read_text(encoding="utf-8").strip()) > 40, f"{init}: a docstring naming its contents"

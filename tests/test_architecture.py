"""The house rules that code review alone would miss: imports run one way, and one of each thing."""

from __future__ import annotations

import ast
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


def test_one_model_definition_and_one_normalization() -> None:
    """nn.Module model classes live in training/model.py only; unicodedata.normalize in text.py only."""
    offenders = []
    for stage in STAGES:
        for p in (REPO / stage).rglob("*.py"):
            src = p.read_text(encoding="utf-8")
            rel = str(p.relative_to(REPO))
            if rel != "training/text.py" and "unicodedata.normalize(" in src:
                offenders.append(f"{rel}: its own Unicode normalization")
            if rel != "training/model.py" and "def rope_cos_sin" in src:
                offenders.append(f"{rel}: its own RoPE")
            if rel != "training/chat.py" and "<|im_start|>assistant" in src and "CHAT_TEMPLATE" not in src:
                offenders.append(f"{rel}: its own chat template")
    assert not offenders, offenders

"""`[project.scripts]`: every console script pyproject declares names a real `main` of the program the
docs run as `python -m ...` / `python training/train.py`, so both spellings start the same code; the
installed wrapper of one of them answers --help (the wrapper itself is pip's, the target is ours)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import REPO

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
# the documented form of each program (README.md, docs/): the console script must start the same main
DOCUMENTED = {
    "prodip-prepare": "training.prepare", "prodip-train": "training/train.py", "prodip-sft": "training/sft.py",
    "prodip-evaluate": "training.evaluate", "prodip-export": "export", "prodip-export-evaluate": "export.evaluate",
    "prodip-serve": "serving", "prodip-demo": "demo", "prodip-quickstart": "demo.quickstart",
}


def test_every_program_has_a_console_script_and_nothing_else_does() -> None:
    assert set(SCRIPTS) == set(DOCUMENTED), sorted(set(SCRIPTS) ^ set(DOCUMENTED))


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_the_console_script_starts_the_documented_programs_main(name: str) -> None:
    module, _, attr = SCRIPTS[name].partition(":")
    target = getattr(importlib.import_module(module), attr)
    form = DOCUMENTED[name]
    if form.endswith(".py"):  # `python training/train.py`: the file's own main
        documented = importlib.import_module(form.removesuffix(".py").replace("/", ".")).main
    else:  # `python -m X`: X/__main__.py (or X.py) calls this main
        spec = importlib.util.find_spec(form)
        path = Path(spec.origin) if spec.submodule_search_locations is None else Path(spec.origin).parent / "__main__.py"
        source = path.read_text(encoding="utf-8")
        assert f"def {attr}(" in source or f"import {attr}" in source, (name, path)
        documented = target if f"def {attr}(" in source else None
        if documented is None:  # `from training.prepare.prepare_cli import main` in __main__.py
            line = next(s for s in source.splitlines() if s.startswith("from ") and s.endswith(f"import {attr}"))
            documented = getattr(importlib.import_module(line.split()[1]), attr)
    assert target is documented, (name, SCRIPTS[name], form)
    out = io.StringIO()
    try:  # argparse's --help exits 0; the project's run_main turns that into a returned 0
        with contextlib.redirect_stdout(out):
            code = target(["--help"])
    except SystemExit as e:
        code = e.code
    assert code == 0 and "usage:" in out.getvalue(), (name, code, out.getvalue()[:200])


def test_the_installed_wrapper_runs() -> None:
    exe = Path(sys.executable).parent / "prodip-export"
    assert exe.is_file(), f"{exe} missing: scripts/setup.sh installs the project with `pip install -e`"
    p = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ""})
    assert p.returncode == 0 and "usage:" in p.stdout, p.stderr[-2000:]

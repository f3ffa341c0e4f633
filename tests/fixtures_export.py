"""Fixtures for the export and parity tests: the suite's one trained run, exported once.

The run is conftest's `tiny_run`: the "tiny" preset (d_model 256, so K-quants apply without fallback)
trained by training/train.py on the corpus that ships in training/assets, gates and all, so every
test here runs on a fresh clone. Texts for tokenizer parity: everything that ships in training/assets
(always), and the 5,120 Tatoeba lines of ../shared/data as opt-in breadth (`tatoeba_lines`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ASSETS, TATOEBA, built_once, shared_path

from training.text.normalization import normalize

GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_K_M")


def shipped_texts() -> list[str]:
    """Every non-empty line of the shipped corpus and every message of the shipped chat set, normalized."""
    out = []
    for f in sorted((ASSETS / "corpus").glob("*.txt")):
        out += [x for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    for f in sorted((ASSETS / "chat").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            out += [m["content"] for m in json.loads(line)["messages"] if m["content"].strip()]
    return [normalize(x) for x in out]


def tatoeba_lines() -> list[str]:
    """The Tatoeba Bangla lines, opt-in breadth (conftest.shared_path: skipped when ../shared/data is absent,
    a failure with PRODIP_SHARED_DATA=1)."""
    return [normalize(x) for x in shared_path(*TATOEBA).read_text(encoding="utf-8").splitlines() if x.strip()]


@pytest.fixture(scope="session")
def trained_run(tiny_run) -> Path:
    return tiny_run


@pytest.fixture(scope="session")
def exported(trained_run, tmp_path_factory) -> Path:
    """The trained run exported to HF + GGUF F32/F16/Q8_0/Q4_K_M (no parity yet); the out dir. Made once:
    conftest registers this module as a plugin (pytest_plugins), no test module defines its own copy."""
    return built_once(tmp_path_factory, "export", lambda root: export_all(trained_run, root))


def export_all(run: Path, out: Path) -> Path:
    from export.gguf.gguf_export import export_gguf
    from export.hf.hf_export import export_hf
    from export.manifest import Manifest, load_source

    src = load_source(run)
    man = Manifest.open(out, src, force=False)
    export_hf(src, out, man)
    export_gguf(src, out, list(GGUF_TYPES), man)
    man.save()
    return out

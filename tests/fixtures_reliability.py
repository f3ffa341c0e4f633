"""Shared artifacts for the reliability tests: a tiny run made by the real CLI, its GGUF, a foreign
tokenizer, a live pickle payload, and helpers to run the CLIs as a user does.

The model is the `tiny` preset shrunk further (one layer, d_model 64, context 64): the reliability
tests restart and kill training dozens of times, so every step and every save must be cheap.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import preloaded
import pytest
from conftest import REPO, built_once

TRAIN_PY = REPO / "training" / "train.py"
ASSETS_CORPUS = REPO / "training" / "assets" / "corpus"
N_CTX = 64
SEQ_LEN, BATCH = 32, 2
# --set flags shrinking `tiny` to ~0.2 M parameters (embeddings dominate; d_model 64, 2 heads of 32)
SHRINK = ("--set", "n_layers=1", "--set", "d_model=64", "--set", "n_heads=2", "--set", "n_kv_heads=1",
          "--set", "ffn_dim=128", "--set", f"max_seq_len={N_CTX}")
CLI_TIMEOUT_S = 300


def child_env(threads: int = 1) -> dict[str, str]:
    """One thread per child: runs are deterministic and several can share two cores."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONDONTWRITEBYTECODE": "1"}


def train_argv(data: Path, out: Path, *extra: str, steps: int = 4, save_every: int = 2) -> list[str]:
    return [sys.executable, str(TRAIN_PY), "--preset", "tiny", *SHRINK, "--data", str(data), "--out", str(out),
            "--max-steps", str(steps), "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN),
            "--save-every", str(save_every), "--eval-every", "0", "--log-every", "1000", "--warmup-steps", "2", *extra]


def run_cli(argv: list[str], *, cwd: Path = REPO, timeout: float = CLI_TIMEOUT_S, **kw) -> subprocess.CompletedProcess:
    return preloaded.run(argv, cwd=cwd, capture_output=True, text=True, env=child_env(), timeout=timeout, **kw)


def call_main(module: str, argv: list, capsys) -> tuple[int, str, str]:
    """A CLI module's main(argv) in-process: (exit status, stdout, stderr)."""
    main = importlib.import_module(module).main
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_error(rc: int, out: str, err: str, *names: str | tuple[str, ...]) -> str:
    """The promise for a refused input: exit != 0, one `error:` line naming one of `names` (strings, or
    tuples of them as the case tables hold them), no traceback."""
    names = tuple(n for x in names for n in ((x,) if isinstance(x, str) else x))
    detail = f"rc {rc}\nstderr:\n{err[-2000:]}\nstdout:\n{out[-1000:]}"
    assert rc not in (0, None), detail
    assert "Traceback" not in out + err, detail
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and lines[0].startswith("error: "), detail
    assert any(n in lines[0] for n in names), f"the error does not name any of {names}\n{detail}"
    return lines[0]


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root (or of root itself): to prove nothing changed."""
    root = Path(root)
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class FileMaker:
    """A pickle payload that creates `marker` when unpickled (builtins.open(marker, "w")): live, not a stub."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_pickle(path: Path, marker: Path) -> None:
    """Write a torch.save file at `path` whose loading with weights_only=False would create `marker`."""
    import torch

    torch.save({"model": FileMaker(marker), "step": 1}, path)


class EntryGuard:
    """Wraps a llama_cpp.Llama: counts how many requests are inside its context at once (a generation
    counts from the call until its stream is closed). Vocabulary lookups (tokenize / detokenize) read
    only the model, never the context, and run while a generation is suspended, so they are not counted."""

    VOCABULARY_ONLY = frozenset({"tokenize", "detokenize", "n_ctx", "n_vocab", "token_bos", "token_eos", "token_nl"})

    def __init__(self, llm):
        self._llm = llm
        self._m = threading.Lock()
        self.active = self.max_active = self.entries = 0

    def _enter(self) -> None:
        with self._m:
            self.active += 1
            self.entries += 1
            self.max_active = max(self.max_active, self.active)

    def _exit(self) -> None:
        with self._m:
            self.active -= 1

    def _gen(self, g):
        try:
            yield from g
        finally:
            self._exit()

    def __setattr__(self, name: str, value) -> None:
        """A transparent wrapper: writes to the Llama's state (the backend's decode loop keeps its cache
        record, input_ids and n_tokens, there) go to the Llama; the guard's own fields stay here."""
        if name.startswith("_") or name in ("active", "max_active", "entries"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._llm, name, value)

    def __getattr__(self, name: str):
        attr = getattr(self._llm, name)
        if not callable(attr) or name in self.VOCABULARY_ONLY:
            return attr

        def wrapped(*a, **k):
            self._enter()
            try:
                r = attr(*a, **k)
            except BaseException:
                self._exit()
                raise
            if hasattr(r, "__next__") and hasattr(r, "close"):
                return self._gen(r)
            self._exit()
            return r

        return wrapped


@pytest.fixture(scope="session")
def rel_run(bn_data, tmp_path_factory) -> Path:
    """A run folder written by `training/train.py` (4 steps, checkpoints at 2 and 4). Copy before changing it."""
    def build(root: Path) -> Path:
        r = run_cli(train_argv(bn_data, root / "run"))
        if r.returncode != 0:
            raise AssertionError(f"train.py failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        return root / "run"

    return built_once(tmp_path_factory, "rel", build)


@pytest.fixture(scope="session")
def foreign_tokenizer(tmp_path_factory) -> Path:
    """A tokenizer.model with the same vocabulary size (2048) trained on other text: same shape, other ids."""
    from training.text.normalization import normalize
    from training.text.tokenizer import train_tokenizer

    lines = [normalize(x) for f in sorted(ASSETS_CORPUS.glob("*.txt"))
             for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    def build(root: Path) -> Path:
        train_tokenizer(lines, 2048, num_threads=1).save(root / "tokenizer.model")
        return root / "tokenizer.model"

    return built_once(tmp_path_factory, "foreign-tok", build)


@pytest.fixture(scope="session")
def rel_gguf(rel_run, tmp_path_factory) -> Path:
    """The tiny run exported to an F32 GGUF through `export.gguf.gguf_export` (in a copy of the run)."""
    from export.gguf.gguf_export import export_gguf
    from export.manifest import Manifest, default_out_dir, load_source

    def build(root: Path) -> Path:
        run = root / "run"
        shutil.copytree(rel_run, run)
        src = load_source(run)
        out = default_out_dir(src)
        manifest = Manifest.open(out, src, force=True)
        paths = export_gguf(src, out, ["F32"], manifest, force=True)
        manifest.save()
        return paths[0]

    return built_once(tmp_path_factory, "rel-gguf", build)

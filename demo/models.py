"""Which models the demo offers: the quickstart's by default, and everything exported beside it.

Kept apart from demo.app so `python -m demo` can say "run the quickstart" without importing Gradio.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from training.checkpoint import latest

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 7860  # this machine only, unless --host says otherwise
QUICKSTART_RUN = Path("runs") / "quickstart"  # demo.quickstart's layout: data/, base/ (pretrained), chat/ (SFT)
QUICKSTART_GGUF_GLOB = "*-Q4_K_M.gguf"
QUICKSTART_CHECKPOINT_RUNS = ("chat", "base")  # prefer the chat-tuned run
HOME_ENV = "PRODIP_HOME"
QUICKSTART_HINT = "run the quickstart first (python -m demo.quickstart) or pass --model PATH"


class DemoError(ValueError):
    pass


@dataclass(frozen=True)
class ModelEntry:
    label: str
    path: Path
    backend: str  # "llama.cpp" | "onnx" | "torch"


def find_run_dir(path: Path) -> Path | None:
    """The run folder holding `path` (a run, a checkpoint, or a file under RUN/export)."""
    for q in [path, *list(path.parents)[:4]]:
        if (q / "checkpoints").is_dir() or (q / "export").is_dir():
            return q
    return None


def entry_for(path: Path) -> ModelEntry:
    if path.suffix == ".gguf":
        return ModelEntry(f"llama.cpp · {path.name}", path, "llama.cpp")
    if path.suffix == ".onnx" or (path.is_dir() and any(path.glob("*.onnx"))):
        name = path.name if path.suffix == ".onnx" else f"{path.name}/"
        parent = path.parent.name
        return ModelEntry(f"onnx · {parent}/{name}", path, "onnx")
    ckpt = latest(path)
    return ModelEntry(f"torch · {(ckpt or path).name}", path, "torch")


def discover_models(model: Path) -> list[ModelEntry]:
    """`model` first, then every .gguf / .onnx / checkpoint of its run (export dir and checkpoints)."""
    if not model.exists():
        raise DemoError(f"model not found: {model}; {QUICKSTART_HINT}")
    entries = [entry_for(model)]
    run = find_run_dir(model)
    if run is not None:
        export = run / "export"
        found = [p for p in sorted((export / "gguf").glob("*.gguf")) + sorted(export.glob("onnx/**/*.onnx"))
                 if not p.name.startswith(".")]  # hidden: an exporter's temporary file
        if latest(run) is not None:
            found.append(run)
        seen = {model.resolve()}
        for p in found:
            if p.resolve() not in seen:
                seen.add(p.resolve())
                entries.append(entry_for(p))
    return entries


def default_model(cwd: Path | None = None) -> Path:
    """The quickstart's Q4_K_M GGUF, else its latest checkpoint; under the current dir or $PRODIP_HOME."""
    bases = [cwd or Path.cwd()]
    if os.environ.get(HOME_ENV):
        bases.append(Path(os.environ[HOME_ENV]))
    for base in bases:
        ggufs = sorted((base / QUICKSTART_RUN / QUICKSTART_CHECKPOINT_RUNS[0] / "export" / "gguf").glob(QUICKSTART_GGUF_GLOB))
        if ggufs:
            return ggufs[0]
    for base in bases:
        for sub in QUICKSTART_CHECKPOINT_RUNS:
            run = base / QUICKSTART_RUN / sub
            if latest(run) is not None:
                return run
    raise DemoError(f"no quickstart model under {' or '.join(str(b / QUICKSTART_RUN) for b in bases)}; {QUICKSTART_HINT}")



"""Which models the demo offers: the quickstart's by default, and everything exported beside it.

Kept apart from demo.app so `python -m demo` can say "run the quickstart" without importing Gradio.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from training.checkpoint.checkpoint_io import latest
from training.runfiles import layout

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 7860  # this machine only, unless --host says otherwise
# demo.quickstart's layout: QUICKSTART_RUN/{data/ (prepared), base/ (pretrained run), chat/ (SFT run)}
QUICKSTART_RUN = Path("runs") / "quickstart"
QUICKSTART_DATA, QUICKSTART_BASE, QUICKSTART_CHAT = "data", "base", "chat"
QUICKSTART_GGUF_GLOB = "*-Q4_K_M.gguf"
QUICKSTART_CHECKPOINT_RUNS = (QUICKSTART_CHAT, QUICKSTART_BASE)  # prefer the chat-tuned run
HOME_ENV = "PRODIP_HOME"
QUICKSTART_HINT = "run the quickstart first (python -m demo.quickstart) or pass --model PATH"


class DemoError(ValueError):
    pass


@dataclass(frozen=True)
class ModelEntry:
    label: str
    path: Path  # the model (for a LoRA pair: its base GGUF)
    backend: str  # "llama.cpp" | "onnx" | "torch"
    adapter: Path | None = None  # a LoRA GGUF applied to `path` at run time (serving.lora_pairs)

    @property
    def adapter_name(self) -> str | None:
        return self.adapter.stem if self.adapter is not None else None


def is_lora_gguf(path: Path) -> bool:
    """A LoRA adapter GGUF (general.type "adapter"), which is applied to a base, not served alone."""
    import gguf

    try:
        f = gguf.GGUFReader(path).fields.get(gguf.Keys.General.TYPE)
    except Exception:  # noqa: BLE001 - gguf-py raises ValueError, struct errors ... on a broken file: no adapter
        return False
    return f is not None and f.contents() == "adapter"


def with_adapters(entries: list[ModelEntry]) -> list[ModelEntry]:
    """Each LoRA GGUF among `entries` paired with every base GGUF there that it fits (right after the base);
    the adapter file itself is no model. An adapter without a base is a DemoError naming it."""
    from serving.backend import ServingError
    from serving.backends.llamacpp_lora import NAME, check_adapter

    loras = [e for e in entries if e.backend == "llama.cpp" and is_lora_gguf(e.path)]
    out = []
    for e in (x for x in entries if x not in loras):
        out.append(e)
        for a in (x.path for x in loras if e.backend == "llama.cpp" and NAME.fullmatch(x.path.stem)):
            try:
                check_adapter(e.path, a)
            except ServingError:
                continue  # an adapter of another base: not offered with this one
            out.append(ModelEntry(f"{e.label} + LoRA {a.stem}", e.path, e.backend, a))
    if loras and not out:
        raise DemoError(f"{loras[0].path} is a LoRA adapter, not a model: pass its base GGUF (--model BASE.gguf) "
                        "or the adapter run's folder")
    return out


def entry_for(path: Path) -> ModelEntry:
    if path.suffix == ".gguf":
        return ModelEntry(f"llama.cpp · {path.name}", path, "llama.cpp")
    if path.suffix == ".onnx" or (path.is_dir() and any(path.glob("*.onnx"))):
        name = path.name if path.suffix == ".onnx" else f"{path.name}/"
        parent = path.parent.name
        return ModelEntry(f"onnx · {parent}/{name}", path, "onnx")
    ckpt = latest(path)
    return ModelEntry(f"torch · {(ckpt or path).name}", path, "torch")


ON_DEVICE = ("llama.cpp", "onnx")  # the files the project ships, in the order the demo prefers them


def parity_result(run: Path | None, path: Path) -> dict | None:
    """This file's entry of RUN/export/parity.json (python -m export parity), or None if not measured."""
    try:
        rep = layout.read_json(run / layout.EXPORT / layout.PARITY_JSON, "parity report") if run is not None else None
    except (layout.LayoutError, OSError):
        return None
    mine = path.resolve()
    for r in (rep or {}).get("backends") or []:
        f = Path(str(r.get("file", ""))) if isinstance(r, dict) else None
        if f is not None and f.name and (f.resolve() == mine or (f.name == path.name and f.parent.name == path.parent.name)):
            return r
    return None


def file_size(path: Path) -> int:
    """Bytes on disk: a file, or everything in a folder (an ONNX folder with its external data)."""
    try:
        return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


def rank(entries: list[ModelEntry], run: Path | None) -> list[ModelEntry]:
    """The default first: on-device files that passed parity (GGUF before ONNX, the smallest first: the
    Q4_K_M GGUF of a quickstart); then the PyTorch checkpoint (the reference); then on-device files whose
    parity failed or was never measured (never the default: nothing says they answer as the model does)."""
    def key(e: ModelEntry) -> tuple[int, int, int]:
        on_device = e.backend in ON_DEVICE
        passed = on_device and bool((parity_result(run, e.path) or {}).get("passed"))
        order = ON_DEVICE.index(e.backend) if on_device else len(ON_DEVICE)
        return (0 if passed else 2 if on_device else 1, order, file_size(e.path) if on_device else 0)

    return sorted(entries, key=key)


def discover_models(model: Path) -> list[ModelEntry]:
    """Every .gguf / .onnx / checkpoint of `model`'s run (export dir and checkpoints). A file named by
    `model` comes first (the user picked it); for a run or checkpoint folder, `rank` picks the default."""
    if not model.exists():
        raise DemoError(f"model not found: {model}; {QUICKSTART_HINT}")
    entries = [entry_for(model)]
    run = layout.run_dir_of(model)
    found: list[Path] = []
    if run is not None:
        export = run / layout.EXPORT
        found = [p for p in sorted((export / layout.GGUF_DIR).glob("*.gguf"))
                 + sorted((export / layout.ONNX_DIR).glob("**/*.onnx"))
                 if not p.name.startswith(".")]  # hidden: an exporter's temporary file
        if latest(run) is not None:
            found.append(run)
    if model.suffix == ".gguf":  # LoRA GGUFs beside a GGUF (export --out's folder, not in a run)
        found += [p for p in sorted(model.parent.glob("*.gguf")) if not p.name.startswith(".") and is_lora_gguf(p)]
    seen = {model.resolve()}
    for p in found:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            entries.append(entry_for(p))
    if model.suffix in (".gguf", ".onnx"):
        return with_adapters([entries[0], *rank(entries[1:], run)])
    return with_adapters(rank(entries, run))


def quickstart_gguf_dir(out: Path) -> Path:
    """Where the quickstart (run with --out OUT) leaves its GGUF files."""
    return out / QUICKSTART_CHAT / layout.EXPORT / layout.GGUF_DIR


def default_model(cwd: Path | None = None) -> Path:
    """The quickstart's Q4_K_M GGUF, else its latest checkpoint; under the current dir or $PRODIP_HOME."""
    bases = [cwd or Path.cwd()]
    if os.environ.get(HOME_ENV):
        bases.append(Path(os.environ[HOME_ENV]))
    for base in bases:
        ggufs = sorted(quickstart_gguf_dir(base / QUICKSTART_RUN).glob(QUICKSTART_GGUF_GLOB))
        if ggufs:
            return ggufs[0]
    for base in bases:
        for sub in QUICKSTART_CHECKPOINT_RUNS:
            run = base / QUICKSTART_RUN / sub
            if latest(run) is not None:
                return run
    raise DemoError(f"no quickstart model under {' or '.join(str(b / QUICKSTART_RUN) for b in bases)}; {QUICKSTART_HINT}")



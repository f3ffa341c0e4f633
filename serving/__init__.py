"""prodip serving: one Backend interface over every runtime, and `load(path)` that picks one.

    backend = serving.load("runs/x/export/gguf/x-Q4_K_M.gguf")    # or a run, a checkpoint, an .onnx, an HF folder
    serving.describe(backend)   # {"kind": "prodip" | "foreign", "arch": ..., "context": ..., ...}
    ids = backend.tokenize("আমার সোনার বাংলা")
    for t in backend.generate(ids, SamplingParams.greedy(16)): ...

RUNTIMES is the one table of backend names and their aliases; runtime modules are imported only when
a file of theirs is loaded (llama.cpp, onnxruntime and transformers are heavy, and transformers is a
dev/test dependency). Any GGUF llama.cpp can run loads (Qwen2, Gemma, ...): files prodip did not write
are "foreign" (`backend.prodip` False) and chat through their own template (serving/backends/llamacpp_backend.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from serving.backend import Backend, SamplingParams, ServingError
from serving.export_files import check_before_load


@dataclass(frozen=True)
class Runtime:
    module: str  # imported on first use
    cls: str
    aliases: tuple[str, ...] = ()


RUNTIMES: dict[str, Runtime] = {
    "llama.cpp": Runtime("serving.backends.llamacpp_backend", "LlamaCppBackend", ("llamacpp", "gguf")),
    "onnx": Runtime("serving.backends.onnxrt_backend", "OnnxBackend", ("onnxruntime", "ort")),
    "torch": Runtime("serving.backends.torch_backend", "TorchBackend", ("pytorch",)),
    "transformers": Runtime("serving.backends.transformers_backend", "TransformersBackend", ("hf",)),
}
ALIASES: dict[str, str] = {a: name for name, rt in RUNTIMES.items() for a in (name, *rt.aliases)}
HF_MARKER = "tokenizer_config.json"  # an HF export folder (export/hf) holds it; a prodip checkpoint does not


def runtime_name(path: str | Path, backend: str | None = None) -> str:
    """The canonical runtime for `path` ("llama.cpp", "onnx", "torch", "transformers"): `backend` (any
    alias) when given, else from the file: .gguf, .onnx (or a folder holding one), an HF folder, else torch."""
    if backend is not None:
        try:
            return ALIASES[backend]
        except KeyError:
            raise ServingError(f"unknown backend {backend!r}; use {', '.join(RUNTIMES)}") from None
    p = Path(path)
    if p.suffix == ".gguf":
        return "llama.cpp"
    if p.suffix == ".onnx" or (p.is_dir() and any(p.glob("*.onnx"))):
        return "onnx"
    if p.is_dir() and (p / HF_MARKER).is_file():
        return "transformers"
    return "torch"


def load(path: str | Path, backend: str | None = None, **kwargs) -> Backend:
    """Open `path` with the runtime `runtime_name` picks; keyword arguments go to that backend
    (every backend takes `threads`). A file of an export folder is first checked against the sizes and
    sha256 its manifest.json lists (serving.export_files)."""
    p = Path(path)
    if not p.exists():
        raise ServingError(f"model not found: {p}")
    rt = RUNTIMES[runtime_name(p, backend)]
    check_before_load(p)  # a file of an export: as its manifest.json lists it, or refused by name
    return getattr(importlib.import_module(rt.module), rt.cls)(p, **kwargs)


def describe(backend: Backend) -> dict:
    """What a backend serves, for a UI: its own `describe()` where it has one (llama.cpp: arch, size,
    quant type, context, prodip or foreign, chat template), else the basics every backend knows."""
    own = getattr(backend, "describe", None)
    if callable(own):
        return own()
    prodip = bool(getattr(backend, "prodip", True))
    return {"name": backend.name, "kind": "prodip" if prodip else "foreign", "prodip": prodip,
            "context": backend.n_ctx, "chat_template": True}


__all__ = ["ALIASES", "RUNTIMES", "Backend", "SamplingParams", "ServingError", "describe", "load", "runtime_name"]

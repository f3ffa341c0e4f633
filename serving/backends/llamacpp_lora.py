"""LoRA GGUFs on a llama.cpp base: checked against the base before llama.cpp loads either, then loaded once
each and switched per generation without reloading the base.

- `check_adapter`: llama.cpp refuses a mismatched adapter too, but deep inside llama-cpp-python (a
  RuntimeError without the reason) or with a message naming one tensor; here an adapter of another
  architecture, one whose tensors name weights the base lacks, or whose shapes do not fit them, is one
  ServingError naming both files.
- `named_adapters`: `lora` as the backend takes it (one path, named by its file stem, or NAME -> path) as
  checked `Adapter`s, in the order given (the first is the default).
- `LoadedAdapters`: every adapter loaded once onto the base's llama_model (llama_adapter_lora_init); `use(ctx,
  name)` sets one on the context (llama_set_adapters_lora; None or BASE_ONLY: none). The model's weights are
  never touched: the adapter is applied at run time, so switching costs a graph re-reserve, not a load.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from serving.backend import CHAT_TUNED_KEY, ServingError

BASE_ONLY = "base"  # the adapter name that asks for the base alone (reserved: no --lora may take it)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # an adapter's name: safe in a model id and a URL
LoraSpec = str | os.PathLike | Mapping[str, str | os.PathLike]

SUFFIXES = (".lora_a", ".lora_b")


def _fields(reader, *keys: str) -> list[object]:
    out = []
    for k in keys:
        f = reader.fields.get(k)
        out.append(None if f is None else f.contents())
    return out


def check_adapter(base: Path, adapter: str | os.PathLike, scale: float = 1.0) -> Path:
    """`adapter`, a LoRA GGUF that fits `base` (a model GGUF); ServingError naming both otherwise."""
    import gguf

    path = Path(adapter)
    if not path.is_file():
        raise ServingError(f"--lora {path}: not found")
    if not math.isfinite(scale):
        raise ServingError(f"--lora-scale {scale}: not a finite number")
    try:
        ar, br = gguf.GGUFReader(path), gguf.GGUFReader(base)
    except (ValueError, OSError) as e:
        raise ServingError(f"--lora {path} on {base}: not a readable GGUF ({e})") from None
    kind, arch, lora_type = _fields(ar, gguf.Keys.General.TYPE, gguf.Keys.General.ARCHITECTURE, gguf.Keys.Adapter.TYPE)
    (base_arch,) = _fields(br, gguf.Keys.General.ARCHITECTURE)
    if kind != "adapter" or lora_type != "lora":
        raise ServingError(f"--lora {path}: not a LoRA adapter GGUF (general.type {kind!r}, adapter.type {lora_type!r})")
    if arch != base_arch:
        raise ServingError(f"--lora {path} is an adapter for architecture {arch!r}; {base} is {base_arch!r}")
    shapes = {t.name: [int(x) for x in t.shape] for t in br.tensors}  # ggml order: (in, out) for a weight
    pairs: dict[str, dict[str, list[int]]] = {}
    for t in ar.tensors:
        stem, suffix = t.name[:-7], t.name[-7:]
        if suffix in SUFFIXES:
            pairs.setdefault(stem, {})[suffix] = [int(x) for x in t.shape]
    if not pairs:
        raise ServingError(f"--lora {path}: holds no lora_a/lora_b tensors")
    for stem, ab in sorted(pairs.items()):
        want = shapes.get(stem)
        a, b = ab.get(".lora_a"), ab.get(".lora_b")
        if want is None:
            raise ServingError(f"--lora {path} adapts {stem}, which {base} does not hold: another base model")
        if a is None or b is None or a[0] != want[0] or b[1] != want[1] or a[1] != b[0]:
            raise ServingError(f"--lora {path} does not fit {base}: {stem} is {want} (in, out) there, the adapter's "
                               f"lora_a {a} and lora_b {b}: an adapter trained on a base of another shape")
    return path


def check_name(name: str, flag: str = "--lora") -> str:
    if not NAME.fullmatch(name) or name == BASE_ONLY:
        why = "is reserved for the base alone" if name == BASE_ONLY else \
            "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        raise ServingError(f"{flag} {name!r}: an adapter name {why}")
    return name


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    scale: float
    chat_tuned: bool | None  # the adapter file's prodip.chat_tuned: an SFT adapter makes a base a chat model


def named_adapters(base: Path, lora: LoraSpec | None, scale: float) -> dict[str, Adapter]:
    """`lora` (a path, named by its stem, or NAME -> path) as Adapters, each checked against `base`."""
    import gguf

    if lora is None:
        return {}
    pairs = lora.items() if isinstance(lora, Mapping) else [(Path(lora).stem, lora)]
    out: dict[str, Adapter] = {}
    for name, path in pairs:
        p = check_adapter(base, path, scale)
        (tuned,) = _fields(gguf.GGUFReader(p), CHAT_TUNED_KEY)
        out[check_name(str(name))] = Adapter(str(name), p, float(scale), tuned if isinstance(tuned, bool) else None)
    return out


class LoadedAdapters:
    """The adapters of one base, loaded once onto its llama_model; one (or none) set on a context at a time."""

    def __init__(self, model: ctypes.c_void_p, base: Path, adapters: dict[str, Adapter]):
        import llama_cpp

        self.adapters, self._ptrs = adapters, {}
        for name, a in adapters.items():
            ptr = llama_cpp.llama_adapter_lora_init(model, str(a.path).encode())
            if not ptr:
                self.free(None)
                raise ServingError(f"--lora {a.path}: llama.cpp cannot apply it to {base}")
            self._ptrs[name] = ptr

    def use(self, ctx: ctypes.c_void_p, name: str | None) -> None:
        """`name`'s adapter on `ctx`, alone (None or BASE_ONLY: the base alone)."""
        import llama_cpp

        if name is None or name == BASE_ONLY:
            llama_cpp.llama_set_adapters_lora(ctx, None, 0, None)
            return
        ptrs = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self._ptrs[name])
        scales = (ctypes.c_float * 1)(self.adapters[name].scale)
        if llama_cpp.llama_set_adapters_lora(ctx, ptrs, 1, scales):
            raise ServingError(f"llama.cpp could not set the adapter {name} ({self.adapters[name].path})")

    def free(self, ctx: ctypes.c_void_p | None) -> None:
        """Take the adapters off `ctx`, then free them (the model would at its end: earlier is tidier)."""
        import llama_cpp

        if ctx is not None:
            llama_cpp.llama_set_adapters_lora(ctx, None, 0, None)
        for ptr in self._ptrs.values():
            llama_cpp.llama_adapter_lora_free(ptr)
        self._ptrs.clear()

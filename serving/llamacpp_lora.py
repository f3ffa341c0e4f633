"""A LoRA GGUF checked against the base GGUF it is to be applied to, before llama.cpp loads either.

llama.cpp refuses a mismatched adapter too, but deep inside llama-cpp-python (a RuntimeError without the
reason) or with a message naming one tensor; here an adapter of another architecture, one whose tensors
name weights the base lacks, or whose shapes do not fit them, is one ServingError naming both files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from serving.backend import ServingError

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

"""An export folder's files against its manifest.json: the size and sha256 `python -m export` recorded
for every file it wrote (export.manifest), checked again before the files are trusted.

Two callers: `python -m export verify EXPORT_DIR` checks every listed file, and every weights file in
the folder that the manifest does not list (export/verify.py); `serving.load` checks the listed files a
load is about to read (`check_before_load`), so a changed byte in RUN/export/gguf/x.gguf is refused by
name instead of answering with damaged weights. Hashing streams each file (training.runfiles.file_ops.sha256_file):
memory stays flat whatever the size; docs/export.md gives the measured seconds per GB.

Here and not in export/ because serving checks before it loads and never imports export (imports run one
way); export imports this module.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from serving.backend import ServingError
from training.runfiles import layout
from training.runfiles.file_ops import sha256_file

SHA256 = re.compile(r"[0-9a-f]{64}")
MODEL_SUFFIXES = (".gguf", ".onnx")  # a file serving.load opens; its sidecars are named MODEL_x or MODEL.x
# files that carry weights: never unlisted (.onnx_data: model.onnx_data; .data: model.onnx.data, older exports)
WEIGHT_SUFFIXES = (*MODEL_SUFFIXES, ".onnx_data", ".data", ".safetensors")
SIDECAR_SEPARATORS = ("_", ".")  # model.onnx_data (export.onnx.onnx_weights), model.onnx.data (exports before it)
MANIFEST_LEVELS = 3  # RUN/export/{gguf/x.gguf, onnx/model.onnx, hf/}: the manifest is 1-2 levels above


@dataclass(frozen=True)
class Manifest:
    """The files an export's manifest.json lists: {posix path relative to `root`: {"size", "sha256"}}."""

    root: Path
    files: dict[str, dict]

    @property
    def path(self) -> Path:
        return self.root / layout.MANIFEST


def _entry_problem(rel: object, entry: object) -> str | None:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in PurePosixPath(rel).parts:
        return f"{rel!r} is not a path inside the export folder"
    if not isinstance(entry, dict):
        return f"{rel}: its entry must be an object"
    size, sha = entry.get("size"), entry.get("sha256")
    if type(size) is not int or size < 0:
        return f"{rel}: 'size' must be a byte count, not {size!r}"
    if not isinstance(sha, str) or not SHA256.fullmatch(sha):
        return f"{rel}: 'sha256' must be 64 hex digits, not {str(sha)[:70]!r}"
    return None


def read(root: str | os.PathLike) -> Manifest:
    """ROOT/manifest.json, each listed path and its size and sha256 checked for form (a manifest naming
    ../x would hash files outside the folder); LayoutError naming the file otherwise."""
    root = Path(root)
    data = layout.read_json(root / layout.MANIFEST, "export manifest", required={"files": dict})
    for rel, entry in data["files"].items():
        if why := _entry_problem(rel, entry):
            raise layout.LayoutError(f"{root / layout.MANIFEST}: {why}")
    return Manifest(root, data["files"])


def check_file(m: Manifest, rel: str) -> str | None:
    """Why ROOT/rel is not the file the manifest lists (missing, another size, another sha256), or None.
    The size is compared first: a truncated or grown file is named without reading it."""
    want, path = m.files[rel], m.root / rel
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != want["size"]:
        return f"{size:,} bytes, the manifest says {want['size']:,}"
    if sha256_file(path) != want["sha256"]:
        return "its sha256 is not the manifest's (the file changed after it was exported)"
    return None


def export_root_of(path: Path) -> Path | None:
    """The folder above `path` (at most MANIFEST_LEVELS up) that holds a prodip manifest.json: a JSON
    object with "prodip_version" (a manifest.json another tool wrote beside a file is none of ours)."""
    p = Path(os.path.abspath(path))
    for q in list(p.parents)[:MANIFEST_LEVELS]:
        f = q / layout.MANIFEST
        if f.is_file():
            head = f.read_bytes()[:4096]
            return q if b'"prodip_version"' in head or not head.lstrip().startswith(b"{") else None
    return None


def _sidecar_of(name: str, models: list[str]) -> str | None:
    return next((m for m in models if any(name.startswith(m + s) for s in SIDECAR_SEPARATORS)), None)


def files_read_by(m: Manifest, path: Path) -> list[str]:
    """The listed files a load of `path` reads: a folder (an HF export), every listed file under it; a
    model file, itself, its sidecars (model.onnx_data) and the listed non-model files beside it
    (tokenizer.model, onnx_config.json), never the other models there (the F16 GGUF beside the Q4_K_M).
    A file the manifest does not list (one the user put there) is not checked."""
    rel = PurePosixPath(Path(os.path.abspath(path)).relative_to(m.root).as_posix())
    if Path(path).is_dir():
        return sorted(r for r in m.files if PurePosixPath(r).is_relative_to(rel) and PurePosixPath(r) != rel)
    if str(rel) not in m.files:
        return []
    beside = [PurePosixPath(r) for r in m.files if PurePosixPath(r).parent == rel.parent]
    models = [r.name for r in beside if r.suffix in MODEL_SUFFIXES]
    return sorted(str(r) for r in beside if r == rel or _sidecar_of(r.name, models) == rel.name
                  or (r.suffix not in MODEL_SUFFIXES and _sidecar_of(r.name, models) is None))


def check_before_load(path: str | os.PathLike) -> None:
    """ServingError naming the first file a load of `path` would read that differs from its export's
    manifest.json (serving.load calls this before it opens anything). Nothing to check: no manifest."""
    root = export_root_of(Path(path))
    if root is None:
        return
    try:
        m = read(root)
    except layout.LayoutError as e:
        raise ServingError(f"{path}: {e}; cannot check the file against it") from None
    for rel in files_read_by(m, Path(path)):
        if why := check_file(m, rel):
            raise ServingError(f"{root / rel}: {why}: it differs from {m.path}, so it is not the exported file; "
                               f"export it again (`python -m export verify {root}` checks every file)")


def unlisted_weights(m: Manifest) -> Iterator[str]:
    """Weights files under ROOT (not in hidden folders) that the manifest does not list, except a hard link
    to, or a byte-identical copy of, a listed file of the same name (ONNX Runtime GenAI's folders link
    the verified model.onnx and model.onnx_data: export.onnx.genai)."""
    by_name: dict[str, list[str]] = {}
    for r in m.files:
        by_name.setdefault(PurePosixPath(r).name, []).append(r)
    for d, dirs, names in os.walk(m.root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for n in sorted(names):
            f = Path(d) / n
            rel = f.relative_to(m.root).as_posix()
            if f.suffix not in WEIGHT_SUFFIXES or rel in m.files:
                continue
            twins = [r for r in by_name.get(n, []) if (m.root / r).is_file()]
            if not any(os.path.samefile(f, m.root / r) or sha256_file(f) == m.files[r]["sha256"] for r in twins):
                yield rel

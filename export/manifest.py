"""The export source (a validated checkpoint, streamed tensor by tensor) and manifest.json.

Every export records where it came from and what it wrote:

    manifest.json  {prodip_version, source: {checkpoint, step, run_dir}, tokenizer_sha256, config,
                    files: {relative path: {format, type, size, sha256, ...}}}

Exports of another checkpoint are never mixed into one manifest: exporting a different checkpoint
into an export folder that already holds one needs --force (which starts a new manifest).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import torch

from export import ExportError
from training.checkpoint import checkpoint_io as checkpoint
from training.model.decoder import ModelConfig
from training.model.gguf_names import TensorNameError, expected_names, lookup
from training.runfiles import layout
from training.runfiles.file_ops import sha256_file
from training.text.tokenizer import Tokenizer


def prodip_version() -> str:
    """The installed package version, else the one in the source tree's pyproject.toml."""
    from importlib import metadata

    try:
        return metadata.version("prodip")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return m.group(1) if m else "unknown"


@dataclass
class Source:
    """A checkpoint that passed every check; tensors are read lazily, one at a time (low peak RSS)."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    state: dict
    run_dir: Path | None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def step(self) -> int | None:
        return self.state.get("step")

    @property
    def name(self) -> str:
        """Base name for exported files: the run folder's name, made file-name safe."""
        raw = (self.run_dir or self.path).name
        return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-") or "prodip"

    def tensor_names(self) -> list[str]:
        return expected_names(self.config)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, fp32 tensor) in writing order, memory-mapped from model.safetensors (a sharded
        checkpoint's tensors assembled one at a time by training.checkpoint.checkpoint_io)."""
        with checkpoint.open_tensors(self.path) as f:
            for name in self.tensor_names():
                yield name, f.get_tensor(name).to(torch.float32)

    def model(self) -> torch.nn.Module:
        """The fp32 reference model (eval mode) through training.checkpoint.checkpoint_io's own loader."""
        model, _ = checkpoint.load_model(self.path)
        return model


def default_out_dir(src: Source) -> Path:
    return (src.run_dir or src.path) / layout.EXPORT


def load_source(path: str | os.PathLike, step: int | None = None) -> Source:
    """Resolve and validate a checkpoint: vocab/tokenizer match (training.checkpoint.checkpoint_io.load), finite
    weights, every tensor known to training.model.gguf_names. Weights are dropped afterwards and re-read lazily."""
    ck = checkpoint.load(path, step)
    checkpoint.check_finite(ck.weights, f"an export of {ck.path}")
    want = set(expected_names(ck.config))
    have = set(ck.weights)
    if want != have:
        raise ExportError(f"{ck.path}: weights do not match the model config "
                          f"(missing {sorted(want - have)[:3]}, unexpected {sorted(have - want)[:3]})")
    try:
        for n in have:
            lookup(n)
    except TensorNameError as e:
        raise ExportError(str(e)) from None
    shapes = {k: tuple(v.shape) for k, v in ck.weights.items()}
    src = Source(ck.path, ck.config, ck.tokenizer, ck.state, layout.run_dir_of(ck.path), shapes)
    del ck
    return src


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


MANIFEST_KEYS = {"source": dict, "files": dict}


def read_manifest(path: Path) -> dict:
    """manifest.json through the one guarded reader: its keys and types checked, the file named when wrong."""
    data = layout.read_json(path, "export manifest", required=MANIFEST_KEYS)
    layout.check_schema(data["source"], str(path), "export manifest's source", required={"checkpoint": str})
    return data


@contextmanager
def made_folder(folder: Path) -> Iterator[Path]:
    """`folder` made (with its parents) for the body's writes; when the body fails, the folders made
    here are removed again, deepest first, as far as they are empty: a failed command leaves no empty
    --out behind (nothing that existed before is touched)."""
    folder = Path(folder)
    made = [p for p in [folder, *folder.parents] if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    except BaseException:
        if made:  # everything under a folder made here is this command's: its empty folders go too
            for root, _, _ in os.walk(folder, topdown=False):
                with suppress(OSError):
                    os.rmdir(root)
        for p in made:
            try:
                p.rmdir()
            except FileNotFoundError:
                continue
            except OSError:  # not empty: files the command wrote before failing stay, named by its error
                break
        raise


def is_export_folder(folder: Path) -> bool:
    """A folder prodip may write into without --force: new, empty, or marked by our manifest.json (written
    before any export lands in it). Never decided from other names a user's folder may also hold (README.md)."""
    return not folder.exists() or (folder / layout.MANIFEST).is_file() or (folder.is_dir() and not any(folder.iterdir()))


class Manifest:
    def __init__(self, out_dir: Path, data: dict):
        self.out_dir = out_dir
        self.data = data

    @classmethod
    def open(cls, out_dir: Path, src: Source, *, force: bool) -> Manifest:
        """The export folder's manifest, started afresh when empty; refuses another checkpoint's
        exports unless `force`."""
        path = out_dir / layout.MANIFEST
        fresh = {
            "prodip_version": prodip_version(),
            "source": {"checkpoint": str(src.path.resolve()), "step": src.step,
                       "run_dir": str(src.run_dir.resolve()) if src.run_dir else None},
            "tokenizer_sha256": src.tokenizer.sha256,
            "config": src.config.to_dict(),
            "files": {},
        }
        if path.exists():
            try:
                old = read_manifest(path)
            except layout.LayoutError as e:
                if not force:
                    raise ExportError(f"{e}; remove it or use --force") from None
                old = {}
            same = (old.get("source", {}).get("checkpoint") == fresh["source"]["checkpoint"]
                    and old.get("source", {}).get("step") == src.step
                    and old.get("tokenizer_sha256") == src.tokenizer.sha256)
            if same:
                old.update({k: fresh[k] for k in ("prodip_version", "config")})
                return cls(out_dir, old)
            if not force:
                raise ExportError(f"{out_dir} holds exports of another checkpoint "
                                  f"({old.get('source', {}).get('checkpoint')} step {old.get('source', {}).get('step')}); "
                                  "use --force to replace them or --out for another folder")
        return cls(out_dir, fresh)

    @classmethod
    def read(cls, out_dir: Path) -> Manifest:
        path = out_dir / layout.MANIFEST
        if not path.is_file():
            raise ExportError(f"{out_dir} holds no {layout.MANIFEST}; export something first")
        return cls(out_dir, read_manifest(path))

    def add(self, path: Path, fmt: str, type_: str, **extra: object) -> dict:
        entry = {"format": fmt, "type": type_, "size": path.stat().st_size, "sha256": sha256_file(path), **extra}
        self.data["files"][path.relative_to(self.out_dir).as_posix()] = entry
        return entry

    def files(self, fmt: str | None = None) -> dict[str, dict]:
        return {k: v for k, v in self.data["files"].items() if fmt is None or v["format"] == fmt}

    def save(self) -> Path:
        path = self.out_dir / layout.MANIFEST
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

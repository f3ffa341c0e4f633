"""`python -m export verify EXPORT_DIR`: every file an export's manifest.json lists, checked against the
size and sha256 recorded when it was written, and no weights file there that the manifest does not list.

Exit 0 and one summary line when every file matches; otherwise exit 2 and one `error:` line naming each
file that differs (missing, another size, another sha256, or weights the manifest does not list). A
manifest that lists no file is a failure too: a check that compared nothing has not passed.
EXPORT_DIR may also be the run folder whose export/ it is. The checks themselves live in
serving.export_files, which serving.load runs before it opens a file of an export.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from export import ExportError
from export.manifest import human_size
from serving.export_files import check_file, read, unlisted_weights
from training.runfiles import layout


def export_root(path: Path) -> Path:
    """EXPORT_DIR itself, or RUN_DIR/export when given the run: the folder holding manifest.json."""
    if not path.is_dir():
        raise ExportError(f"{path}: {'not found' if not path.exists() else 'not a folder'} (give an export folder)")
    if not (path / layout.MANIFEST).is_file() and (path / layout.EXPORT / layout.MANIFEST).is_file():
        return path / layout.EXPORT
    if not (path / layout.MANIFEST).is_file():
        raise ExportError(f"{path}: holds no {layout.MANIFEST}, so it is not a prodip export folder")
    return path


def verify(path: Path) -> tuple[int, int]:
    """(files checked, their bytes); ExportError naming every file that differs from the manifest."""
    try:
        m = read(export_root(path))
    except layout.LayoutError as e:
        raise ExportError(str(e)) from None
    if not m.files:
        raise ExportError(f"{m.path} lists no files: nothing to verify (export something first)")
    bad = [f"{rel} ({why})" for rel in sorted(m.files) if (why := check_file(m, rel))]
    bad += [f"{rel} (weights the manifest does not list)" for rel in unlisted_weights(m)]
    if bad:
        raise ExportError(f"{m.root}: {len(bad)} file(s) differ from {layout.MANIFEST}: {'; '.join(bad)}")
    return len(m.files), sum(e["size"] for e in m.files.values())


def run_verify(args: argparse.Namespace, defaults: dict) -> int:
    """The `verify` command of `python -m export`: only EXPORT_DIR (and --debug) apply to it."""
    unused = [k for k, v in vars(args).items() if k not in ("command", "path", "debug") and v != defaults.get(k)]
    if unused:
        raise ExportError(f"--{unused[0].replace('_', '-')} does not apply to `verify` (it takes EXPORT_DIR only)")
    if isinstance(args.path, str):  # a store URL: its files were checked against their commit marker on upload
        raise ExportError(f"verify {args.path}: takes a local export folder, not a store URL")
    t0 = time.perf_counter()
    n, size = verify(args.path)
    print(f"verified {n} files ({human_size(size)}) against {layout.MANIFEST}: every size and sha256 matches "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0

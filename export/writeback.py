"""Exports written back next to their run in object storage.

    python -m export gguf s3://BUCKET/RUN --q4

pulls the run's newest committed checkpoint into its cache (training.store.remote_run.pull_run), exports into
CACHE/export/ as for a local run, and, once the export's parity run has passed, uploads that folder to
URL/export/ with the commit marker of checkpoints (training.store.remote_run.Remote.commit): every file first,
then URL/export.commit.json naming each file's size and sha256, last. A reader trusts URL/export/ only
through that marker (`committed_export`). An export already at the URL is never replaced without
--force (checked before anything is pulled or written); with --force the old marker goes first, then
the old files, then the new ones are uploaded. `--out DIR` exports to DIR only, as for a local run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from export import ExportError
from export.manifest import human_size
from training.runfiles import layout
from training.store.remote_run import EXPORT_COMMIT, Remote, RemoteError, Unreachable


def open_run(url: str, force: bool) -> Remote:
    """The run at `url`, checked before anything is pulled or written: ExportError when it holds an
    export already (unless --force), RemoteError on bad input or a store that does not answer."""
    r = Remote(url, "RUN_DIR")
    try:
        r.check()
        present = bool(r.names(layout.EXPORT)) or EXPORT_COMMIT in r.names()
    except Unreachable as e:
        raise RemoteError(f"RUN_DIR {url}: {e}") from None
    if present and not force:
        raise ExportError(f"{r.url}/{layout.EXPORT} exists; use --force to replace it (nothing was written)")
    return r


def local_files(out: Path) -> dict[str, Path]:
    """Every file of the export folder by its path under it (hidden temporaries left out)."""
    return {p.relative_to(out).as_posix(): p for p in sorted(out.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(out).parts)}


def write_back(r: Remote, out: Path, step: int, say: Callable[[str], None]) -> dict:
    """The export folder `out` to URL/export/, committed last; its marker. RemoteError when the store fails
    (the exports stay in `out`; the same command with --force uploads them again)."""
    files = local_files(out)
    try:
        r.remove(EXPORT_COMMIT)  # an old export stops counting before any of its files changes
        r.remove(layout.EXPORT, recursive=True)
        marker = r.commit(files, layout.EXPORT, EXPORT_COMMIT, step=step)
    except Unreachable as e:
        raise RemoteError(f"RUN_DIR {r.url}: {e} while uploading the exports; they are in {out} (the same "
                          "command with --force uploads them)") from None
    total = sum(v["size"] for v in marker["files"].values())
    say(f"uploaded {len(files)} files ({human_size(total)}) to {r.url}/{layout.EXPORT}/, committed by "
        f"{r.url}/{EXPORT_COMMIT}")
    return marker


def committed_export(r: Remote) -> dict | None:
    """The marker of the export at URL/export/ when it is complete (names exactly the files there)."""
    return r.read_commit(layout.EXPORT, EXPORT_COMMIT)

"""Files named on a command line: each file as given, each folder expanded to the files in it.

One rule for every CLI that takes files or folders (prepare's --input, --decontaminate, evaluate's
--mc): sorted (deterministic order), hidden files and folders skipped, missing paths and folders
without a usable file refused with an error that says what was expected, and a file whose name is not
UTF-8 refused by name before anything is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from training.store.urls import RemoteError, is_url, parse_url
from training.text.normalization import check_arg


def expand_files(paths: Sequence[str | Path], error: type[Exception], *, what: str,
                 suffixes: Sequence[str] = (), recursive: bool = True) -> list[Path]:
    """Files as given; folders expand (recursively unless told otherwise) to their files, or to those
    whose suffix is in `suffixes` when given. `what` names the input in errors ("input", "--mc file")."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            walk = p.rglob("*") if recursive else p.iterdir()
            found = sorted(f for f in walk if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts)
                           and (not suffixes or f.suffix.lower() in suffixes))
            if not found:
                kinds = f" ({'/'.join(suffixes)})" if suffixes else ""
                raise error(f"{what} folder has no files{kinds}: {p}")
            for f in found:  # a name that is not UTF-8 would crash every later print and report
                check_arg(str(f), f"{what}", error)
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise error(f"{what} not found: {p}")
    return out


def umask() -> int:
    """The process's umask, read without changing it (os.umask sets while it reads: a race with the
    checkpoint writer's thread), from /proc where there is one."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: Mapping, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file, and the file then gets the mode every other file of ours gets
    (0666 less the user's umask): save_file writes through a private temporary file of mode 0600,
    so exported weights would be unreadable to everyone but their owner."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())


@contextlib.contextmanager
def removed_on_failure(tmp: Path, disk_error: Callable[[str], Exception]) -> Iterator[None]:
    """A folder written beside its place (then renamed into it): any failure removes it, so nothing
    half-written stays; an OSError or a safetensors write error (a full disk: ENOSPC, EFBIG, EDQUOT, a
    read-only folder) is raised as `disk_error(the OS's words)`, one line, without a traceback."""
    from safetensors import SafetensorError  # safetensors' own error for a failed write

    try:
        yield
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_error(" ".join(str(e).split())[:300]) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


HASH_CHUNK = 1 << 22  # bytes read at a time when hashing a file


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike, *, link: bool = True) -> Path:
    """`dst` as a hard link to `src` (the same bytes, no second copy of a model on disk), or a copy across file
    systems or with `link=False`; through a temporary name and one rename, so an existing `dst` is replaced whole
    and a reader never sees half a file. The one way exports place files they did not write themselves."""
    import shutil

    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        if not link:
            raise OSError("a copy was asked for")
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return dst


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, read in chunks (checkpoints and exports can be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Input(NamedTuple):
    """One thing a command reads, for check_apart: its flag (as the error names it) and its path or URL.
    `out_inside_ok`: the output may lie inside it (a run's own RUN/export or RUN/eval folder)."""
    flag: str
    path: str | os.PathLike | None
    out_inside_ok: bool = False


def _relation(out: tuple[str, ...], inp: tuple[str, ...]) -> str | None:
    """How the place `out` stands to `inp` (each as its segments): "is", "is inside", "holds", or None."""
    n = min(len(out), len(inp))
    if out[:n] != inp[:n]:
        return None
    return "is" if len(out) == len(inp) else "is inside" if len(out) > len(inp) else "holds"


def _place(value: str | os.PathLike, flag: str) -> tuple[str, ...]:
    """A path's segments once resolved (symbolic links, `..`, relative spellings), or a URL's place."""
    if is_url(value):
        return parse_url(str(value), flag).place
    return Path(os.path.realpath(value)).parts


def check_apart(out_flag: str, out: str | os.PathLike | None, inputs: Iterable[Input | tuple],
                error: type[Exception]) -> None:
    """Outputs never overlap inputs: `error` naming both flags when `out` is one of `inputs`, holds one,
    or lies inside one (unless that input allows it), whatever --force says. Local paths are compared
    resolved (`.`, `..`, a relative spelling, symbolic links: one folder is one folder however it is
    named); store URLs by their place (gs:// and gcs://, a trailing /). A local path and a URL never
    overlap. Absent values (None, "") and hf:NAME inputs are skipped."""
    if not out:
        return
    try:
        out_place = _place(out, out_flag)
    except RemoteError as e:  # a malformed URL --out, refused as the command's own error
        raise error(str(e)) from None
    for item in inputs:
        inp = Input(*item)
        if not inp.path or str(inp.path).startswith("hf:") or is_url(inp.path) != is_url(out):
            continue
        try:
            rel = _relation(out_place, _place(inp.path, inp.flag))
        except RemoteError:
            continue  # a malformed input URL is refused by name where that flag is read
        if rel == "is inside" and inp.out_inside_ok:
            continue
        if rel:
            raise error(f"{out_flag} {out} {rel} {inp.flag} {inp.path}: a command never writes where it reads "
                        f"(--force included); choose another {out_flag}")

"""Files named on a command line: each file as given, each folder expanded to the files in it.

One rule for every CLI that takes files or folders (prepare's --input, --decontaminate, evaluate's
--mc): sorted (deterministic order), hidden files and folders skipped, missing paths and folders
without a usable file refused with an error that says what was expected, and a file whose name is not
UTF-8 refused by name before anything is read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from training.text import check_arg


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


HASH_CHUNK = 1 << 22  # bytes read at a time when hashing a file


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, read in chunks (checkpoints and exports can be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()

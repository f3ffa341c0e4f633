"""Files named on a command line: each file as given, each folder expanded to the files in it.

One rule for every CLI that takes files or folders (prepare's --input, --decontaminate, evaluate's
--mc): sorted (deterministic order), hidden files and folders skipped, missing paths and folders
without a usable file refused with an error that says what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


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
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise error(f"{what} not found: {p}")
    return out

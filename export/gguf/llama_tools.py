"""llama.cpp's own programs (llama-cli, llama-server, llama-bench, llama-perplexity, llama-imatrix,
llama-quantize), built by `scripts/build_llama_tools.sh` from the llama.cpp tree vendored in the
pinned llama-cpp-python sdist, so they run the same llama.cpp code as `serving.backends.llamacpp_backend`.

Where a tool is looked for, first hit wins:
  1. $PRODIP_LLAMA_TOOLS (a folder holding the binaries),
  2. ~/.cache/prodip/llama-tools/latest (the build script points it at its newest build),
  3. $PATH (a user's own llama.cpp install).
A missing tool is one ExportError line naming the tool and how to build it. A leaf of `export`:
imports only the standard library and `export.ExportError`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from export import ExportError

TOOLS = ("llama-cli", "llama-server", "llama-bench", "llama-perplexity", "llama-imatrix", "llama-quantize")
ENV_DIR = "PRODIP_LLAMA_TOOLS"
CACHE_LATEST = Path.home() / ".cache" / "prodip" / "llama-tools" / "latest"
BUILD_HINT = "build it with `bash scripts/build_llama_tools.sh` (or set PRODIP_LLAMA_TOOLS to a folder holding it)"
STDERR_TAIL_LINES = 3  # how much of a failing tool's stderr goes into the one-line error


def _candidates(name: str) -> list[Path]:
    dirs = [Path(d) for d in (os.environ.get(ENV_DIR),) if d] + [CACHE_LATEST]
    found = [d / name for d in dirs]
    on_path = shutil.which(name)
    if on_path:
        found.append(Path(on_path))
    return found


def find_tool(name: str) -> Path | None:
    """The executable for `name` (one of TOOLS), or None when it is not installed anywhere we look."""
    if name not in TOOLS:
        raise ExportError(f"unknown llama.cpp tool {name!r}; prodip uses {', '.join(TOOLS)}")
    for p in _candidates(name):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def tool_path(name: str) -> Path:
    """Like find_tool, but a missing tool raises ExportError with the build hint."""
    p = find_tool(name)
    if p is None:
        raise ExportError(f"llama.cpp tool {name} not found; {BUILD_HINT}")
    return p


def missing_tools(names: Sequence[str] = TOOLS) -> list[str]:
    return [n for n in names if find_tool(n) is None]


def _tail(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-STDERR_TAIL_LINES:]) or "no output"


def run_tool(name: str, args: Sequence[str | os.PathLike], *, timeout: float = 1800,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run one llama.cpp tool to completion; a non-zero exit is an ExportError carrying the last
    lines of its stderr (llama.cpp logs to stderr, so the reason is there)."""
    exe = tool_path(name)
    cmd = [str(exe), *(str(a) for a in args)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout,
                           env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ExportError(f"{name} did not finish in {timeout:.0f} s") from None
    if p.returncode != 0:
        raise ExportError(f"{name} failed (exit {p.returncode}): {_tail(p.stderr or p.stdout)}")
    return p

"""README command 1 end to end, shortened: the shipped corpus -> pretrain -> SFT -> export all ->
parity, then a second run that reuses everything (the demo itself is covered by test_demo/test_browser)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO


def quickstart(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "demo.quickstart", "--out", str(out), "--no-demo", "--preset", "tiny",
           "--steps", "60", "--sft-steps", "20", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1500)


def test_quickstart_runs_every_stage_then_reuses_them(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    p = quickstart(out)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for stage in ("prepare", "pretrain", "sft", "export + parity"):
        assert f"=== {stage}: done" in p.stdout
    report = json.loads((out / "data" / "report.json").read_text())
    assert all(g["passed"] for g in report["gates"])
    assert json.loads((out / "base" / "gates.json").read_text())["passed"]
    assert json.loads((out / "chat" / "config.json").read_text())["kind"] == "sft"
    export = out / "chat" / "export"
    assert sorted(p.name.split("-")[-1] for p in (export / "gguf").glob("*.gguf")) == \
        ["F16.gguf", "Q4_K_M.gguf", "Q8_0.gguf"]
    assert (export / "onnx" / "model.onnx").is_file() and (export / "hf" / "model.safetensors").is_file()
    parity = json.loads((export / "parity.json").read_text())
    assert parity["passed"], parity.get("summary")
    assert (export / "parity.md").is_file() and (export / "README.md").is_file()

    t0 = time.perf_counter()
    again = quickstart(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "=== pretrain" not in again.stdout and "=== export" not in again.stdout
    assert time.perf_counter() - t0 < 60

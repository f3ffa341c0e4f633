"""Parity rows "llama.cpp aarch64 (emulated)": each GGUF run by llama.cpp's ARM kernels under qemu-user.

Phones run ggml's aarch64 kernels (NEON, dotprod, i8mm), never the x86 ones the rest of parity
exercises. scripts/build_llama_arm.sh cross-builds, from the same llama.cpp source as the x86 binding,
a small runner (scripts/arm_runner) for armv8.2-a+dotprod+fp16 and, where qemu runs it, for
armv8.6-a+i8mm. For every GGUF in the manifest and every runner built, on every parity prompt (token
ids in, so no tokenizer can hide a kernel difference):

- the runner decodes the prompt and `n_new` greedy tokens under `qemu-aarch64 -cpu CPU`, one thread,
  and writes the ids and every logit row (prompt positions and each generated step);
- x86: llama-cpp-python decodes the same ids the same way (prompt in one batch, then one token at a
  time, F32 KV cache): its argmax must give the ARM ids at every step (so its own greedy run is
  the same ids), and max |ARM - x86| logit must stay within ARM_X86_MAX_ABS;
- the PyTorch fp32 checkpoint on the same sequences: KL / top-1 / max_abs within the thresholds of the
  file's kind (llama.cpp-Q4_K_M, ...), the same limits the x86 row of that file meets.
Emulated time is not a device's speed, so no timing is recorded.
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from export import ExportError
from export.manifest import Manifest, Source
from export.parity.native_parity import LOWER_BOUNDS, Reference, reference_backend
from serving.backends.llamacpp_backend import LlamaCppBackend, read_gguf_info
from training.model.logprobs import kl_rows

BUILD_SCRIPT = "scripts/build_llama_arm.sh"
QEMU = "qemu-aarch64"
ROW = "llama.cpp aarch64 (emulated)"
# runner variant -> the qemu CPU it runs on. Cortex-A76 (2018; Snapdragon 855 class) has dotprod and
# fp16 but no i8mm, so the dotprod build is shown to need nothing a common phone core lacks; `max`
# enables every feature qemu emulates (i8mm included).
VARIANTS: dict[str, str] = {"dotprod": "cortex-a76", "i8mm": "max"}
# max |ARM logit - x86 logit| on the same file and ids, per GGML file type: the same graph on other SIMD
# kernels. Measured (docs/arm.md: the suite's tiny model, all 11 parity prompts, 16 new tokens; the
# larger of the dotprod and i8mm runners): F32 9.1e-6 (float summation order only); Q8_0 8.1e-3 and
# Q4_K_M 1.1e-2 (the same integer dot products, other float scaling and sums); F16 4.2e-2: ggml's
# aarch64 F16 kernels accumulate in half precision (vfmaq_f16) where x86 converts to F32 first.
# Bounds: ~4x the measured figure (F32: parity's fp32 bound).
ARM_X86_MAX_ABS: dict[str, float] = {"F32": 1e-4, "F16": 0.15, "Q8_0": 0.05, "Q4_K_M": 0.05}
ARM_X86_DEFAULT = 0.1  # other quantized types: not measured; twice the Q8_0/Q4_K_M bound
MAGIC = b"PRODIPA1"
QEMU_TIMEOUT_S = 600


@dataclass
class ArmRun:
    """One prompt's ARM result: the greedy ids and the logit rows of prompt + ids[:-1]."""

    ids: list[int]
    rows: np.ndarray


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def find_runners() -> dict[str, Path]:
    """variant -> runner binary, from `scripts/build_llama_arm.sh --print`; none built or no qemu: one
    ExportError naming the script (checked before anything is written)."""
    script = repo_root() / BUILD_SCRIPT
    p = subprocess.run(["bash", str(script), "--print"], capture_output=True, text=True, check=False) \
        if script.is_file() else None
    if p is None or p.returncode != 0:
        raise ExportError(f"--arm: the aarch64 llama.cpp runner is not built: run {BUILD_SCRIPT} "
                          "(needs g++-aarch64-linux-gnu and qemu-user)")
    if shutil.which(QEMU) is None:
        raise ExportError(f"--arm: {QEMU} not found (apt-get install qemu-user); {BUILD_SCRIPT} builds the runner")
    folder = Path(p.stdout.strip().splitlines()[-1])
    return {v: folder / f"prodip-arm-runner-{v}" for v in VARIANTS if (folder / f"prodip-arm-runner-{v}").is_file()}


def check_arm_flag(args: argparse.Namespace) -> None:
    """`python -m export ... --arm` needs a parity run to read it and a built runner: refused by name otherwise."""
    if not args.arm:
        return
    if args.no_parity and args.command != "parity":
        raise ExportError("--arm: no parity run reads it with --no-parity")
    find_runners()


def read_output(path: Path) -> list[ArmRun]:
    """The runner's OUT.bin (format in scripts/arm_runner/runner.cpp)."""
    data = path.read_bytes()
    if data[:8] != MAGIC:
        raise ExportError(f"{path}: not a prodip-arm-runner output")
    n_vocab, n_prompts = struct.unpack_from("<ii", data, 8)
    off, runs = 16, []
    for _ in range(n_prompts):
        n_ids, n_rows = struct.unpack_from("<ii", data, off)
        off += 8
        ids = np.frombuffer(data, "<i4", n_ids, off).tolist()
        off += 4 * n_ids
        rows = np.frombuffer(data, "<f4", n_rows * n_vocab, off).reshape(n_rows, n_vocab)
        off += 4 * n_rows * n_vocab
        runs.append(ArmRun(ids, rows))
    return runs


def run_arm(runner: Path, cpu: str, gguf: Path, prompts: Sequence[Sequence[int]], n_new: int) -> list[ArmRun]:
    """The runner under `qemu-aarch64 -cpu CPU` on every prompt: one process, one model load."""
    with tempfile.TemporaryDirectory(prefix="prodip-arm-") as tmp:
        ids_file, out = Path(tmp) / "prompts.txt", Path(tmp) / "out.bin"
        ids_file.write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts), encoding="ascii")
        p = subprocess.run([QEMU, "-cpu", cpu, str(runner), str(gguf), str(ids_file), str(n_new), str(out)],
                           capture_output=True, text=True, timeout=QEMU_TIMEOUT_S, check=False)
        if p.returncode != 0:
            raise ExportError(f"{runner.name} on {gguf.name} under {QEMU} -cpu {cpu} failed "
                              f"(exit {p.returncode}): {p.stderr.strip()[-300:]}")
        return read_output(out)


def run_capped(runner: Path, cpu: str, gguf: Path, prompts: Sequence[Sequence[int]], n_new: int,
               n_ctx: int) -> list[ArmRun]:
    """run_arm with each continuation capped where x86 llama.cpp stops (prompt + new tokens <= n_ctx):
    the runner's own cap is llama.cpp's context, padded to a multiple of 256, which may be larger."""
    caps = [max(1, min(n_new, n_ctx - len(p) + 1)) for p in prompts]
    runs: list[ArmRun] = [ArmRun([], np.zeros((0, 0), np.float32))] * len(prompts)
    for cap in sorted(set(caps)):  # usually two calls: the short prompts, and parity's long one
        idx = [i for i, c in enumerate(caps) if c == cap]
        for i, r in zip(idx, run_arm(runner, cpu, gguf, [prompts[i] for i in idx], cap), strict=True):
            runs[i] = r
    return runs


def leading_equal(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare_runs(prompts: Sequence[Sequence[int]], runs: Sequence[ArmRun], x86: Callable[[list[int], int], np.ndarray],
                 torch: Callable[[list[int]], np.ndarray]) -> dict:
    """The ARM runs against x86 (`x86(seq, prefix)`: KV-cache logits) and the fp32 reference (`torch(seq)`)."""
    m = {"greedy_match": 0, "greedy_total": 0, "greedy_equal": 0, "greedy_prompts": len(prompts),
         "arm_x86_max_abs": 0.0, "max_abs": 0.0, "top1": 0.0, "kl": 0.0, "positions": 0, "shape_errors": 0}
    kls, agree = [], 0
    for prompt, run in zip(prompts, runs, strict=True):
        seq = [*prompt, *run.ids[:-1]]
        if run.rows.shape[0] != len(seq) or not run.ids:
            m["shape_errors"] += 1
            continue
        xr, rr = x86(seq, len(prompt)), torch(seq)
        if xr.shape != run.rows.shape or rr.shape != run.rows.shape:
            m["shape_errors"] += 1
            continue
        x86_ids = xr[len(prompt) - 1:].argmax(-1).tolist()  # x86 greedy, fed the ARM ids: equal iff identical runs
        same = leading_equal(x86_ids, run.ids)
        m["greedy_match"] += same
        m["greedy_total"] += len(run.ids)
        m["greedy_equal"] += int(same == len(run.ids))
        arm = run.rows.astype(np.float64)
        m["arm_x86_max_abs"] = max(m["arm_x86_max_abs"], nan_max(np.abs(arm - xr)))
        m["max_abs"] = max(m["max_abs"], nan_max(np.abs(arm - rr)))
        kls.append(kl_rows(rr, run.rows))
        agree += int((run.rows.argmax(-1) == rr.argmax(-1)).sum())
        m["positions"] += len(seq)
    if kls:
        m["kl"], m["top1"] = float(np.concatenate(kls).mean()), agree / m["positions"]
    return m


def nan_max(a: np.ndarray) -> float:
    """max of `a`, infinite when a NaN is in it (max() would let a NaN through)."""
    v = float(a.max()) if a.size else 0.0
    return float("inf") if np.isnan(v) else v


def failures(m: dict, limits: Mapping[str, float], tolerance: float) -> list[str]:
    out = [f"{m['shape_errors']} of {m['greedy_prompts']} prompts returned malformed logits"] if m["shape_errors"] else []
    if m["positions"] == 0:
        out.append("no position was compared")
    if m["greedy_equal"] != m["greedy_prompts"]:
        out.append(f"greedy ids differ from x86 on {m['greedy_prompts'] - m['greedy_equal']} of "
                   f"{m['greedy_prompts']} prompts")
    if not m["arm_x86_max_abs"] <= tolerance:  # `not <=`: a NaN fails
        out.append(f"ARM vs x86 max |Δlogit| {m['arm_x86_max_abs']:.3g} > {tolerance:g}")
    for metric, limit in limits.items():
        v = m[metric]
        if not (v >= limit if metric in LOWER_BOUNDS else v <= limit):
            out.append(f"{metric} {v:.3g} not {'>=' if metric in LOWER_BOUNDS else '<='} {limit:g}")
    return out


def gguf_files(out_dir: Path, manifest: Manifest) -> list[Path]:
    """The prodip GGUFs the manifest lists (what parity's x86 rows compare), in name order."""
    return [out_dir / rel for rel, e in sorted(manifest.files().items())
            if e["format"] == "gguf" and rel.endswith(".gguf") and read_gguf_info(out_dir / rel).prodip]


def arm_rows(src: Source, ggufs: Sequence[Path], prompts: Sequence[Sequence[int]], n_new: int,
             thresholds: Mapping[str, Mapping[str, float]], *, runners: Mapping[str, Path] | None = None,
             progress: Callable[[str], None] | None = None) -> list[dict]:
    """One parity row per GGUF file and runner variant (see the module docstring)."""
    runners = find_runners() if runners is None else runners
    reference, cache = reference_backend(src), {}

    def torch(seq: list[int]) -> np.ndarray:
        if tuple(seq) not in cache:
            cache[tuple(seq)] = reference.logits(seq)
        return cache[tuple(seq)]

    rows = []
    try:
        for gguf in ggufs:
            ftype = read_gguf_info(gguf).type_name or "?"
            kind, tolerance = f"llama.cpp-{ftype}", ARM_X86_MAX_ABS.get(ftype, ARM_X86_DEFAULT)
            with LlamaCppBackend(gguf, threads=1) as x86:
                for variant, runner in runners.items():
                    if progress:
                        progress(f"parity: {ROW} {gguf.name} [{variant}, qemu -cpu {VARIANTS[variant]}]")
                    runs = run_capped(runner, VARIANTS[variant], gguf, prompts, n_new, x86.n_ctx)
                    m = compare_runs(prompts, runs, lambda s, k: x86.logits_incremental(s, prefix=k), torch)
                    rows.append(row(gguf, kind, variant, m, dict(thresholds.get(kind, {})), tolerance))
    finally:
        reference.close()
    return rows


def row(gguf: Path, kind: str, variant: str, m: dict, limits: dict, tolerance: float) -> dict:
    fails = failures(m, limits, tolerance)
    name = f"{ROW} {kind.removeprefix('llama.cpp-')} [{variant}]"
    summary = (f"{name}: greedy ids equal to x86 llama.cpp on {m['greedy_equal']}/{m['greedy_prompts']} prompts "
               f"({m['greedy_match']}/{m['greedy_total']} tokens); max |ARM - x86| logit {m['arm_x86_max_abs']:.2e} "
               f"(tolerance {tolerance:g}); under {QEMU} -cpu {VARIANTS[variant]}, emulated: no speed measured")
    return {"name": name, "kind": kind, "file": str(gguf), **m, "arm_x86_tolerance": tolerance, "variant": variant,
            "qemu_cpu": VARIANTS[variant], "thresholds": limits, "summary": summary,
            "notes": ["greedy match is against the x86 llama.cpp run of the same file; ids in, no tokenizer"],
            "passed": not fails, "failures": fails}


def arm_results(src: Source, out_dir: Path, ref: Reference, thresholds: Mapping[str, Mapping[str, float]],
                progress: Callable[[str], None] | None = None) -> list[dict]:
    """export.parity.native_parity's extra-rows hook (`python -m export parity RUN --arm`): every GGUF of the export,
    on the reference's prompts and continuation length."""
    return arm_rows(src, gguf_files(out_dir, Manifest.read(out_dir)), ref.ids, ref.n_new, thresholds,
                    progress=progress)

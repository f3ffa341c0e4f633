"""Throughput, MFU, cost and the live progress line; the JSONL step log."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

# Dense bf16 tensor-core peak FLOP/s (no sparsity), per GPU, from the vendors' data sheets.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989.4e12,
    "H100 SXM": 989.4e12,
    "H100 NVL": 835.0e12,
    "H100 PCIe": 756.0e12,
    "H100": 989.4e12,  # unspecified form factor: assume SXM
    "GH200": 989.4e12,
    "B200": 2250e12,
    "A100": 312.0e12,
    "A10G": 125.0e12,
    "A10": 125.0e12,
    "L40S": 362.05e12,
    "L4": 121.0e12,
    "RTX 4090": 165.2e12,
    "RTX 3090": 71.0e12,
}


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak bf16 FLOP/s, GPU name) for a CUDA device; (None, name) when unknown or not CUDA."""
    if device.type != "cuda":
        return None, device.type
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # most specific name first
        if all(part in name for part in key.split()):
            if key == "H100" and "PCIe" in name:
                continue
            return PEAK_BF16_FLOPS[key], name
    return None, name


def fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


class StepLog:
    """RUN_DIR/log.jsonl: one JSON record per optimizer step (and eval/event records)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._f = open(self.path, "a", encoding="utf-8") if enabled else None  # noqa: SIM115 (held for the run)

    def truncate_after(self, step: int) -> None:
        """On resume: drop records past the checkpoint so the log continues exactly."""
        if not self.enabled or not self.path.exists():
            return
        self._f.close()
        keep = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash
            if rec.get("step", 0) <= step:
                keep.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")  # atomic: a crash here must not lose the log
        tmp.write_text("".join(k + "\n" for k in keep), encoding="utf-8")
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


class Throughput:
    """Tokens/s over a sliding window of recent steps, MFU, ETA and dollar cost."""

    def __init__(self, flops_per_token: float, peak: float | None, n_gpus: int, hourly_usd: float, window: int = 20):
        self.fpt, self.peak, self.n_gpus, self.hourly = flops_per_token, peak, n_gpus, hourly_usd
        self.window = window
        self.samples: list[tuple[float, int]] = []
        self.start = time.perf_counter()
        self.elapsed_before = 0.0  # from earlier segments of a resumed run

    def update(self, tokens_total: int) -> None:
        self.samples.append((time.perf_counter(), tokens_total))
        self.samples = self.samples[-(self.window + 1):]

    @property
    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.start

    @property
    def tokens_per_s(self) -> float:
        if len(self.samples) < 2:
            return float("nan")
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)

    @property
    def mfu(self) -> float | None:
        if self.peak is None or not math.isfinite(self.tokens_per_s):
            return None
        return self.tokens_per_s * self.fpt / (self.peak * self.n_gpus)

    def cost(self, seconds: float) -> float:
        return seconds / 3600 * self.hourly * self.n_gpus

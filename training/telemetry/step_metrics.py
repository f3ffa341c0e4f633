"""Throughput, MFU (two FLOP conventions), the GPU peak table, cost; the JSONL step log, which also
draws RUN/curves.png at each evaluation and feeds the optional live tracker (--log-to tensorboard).

MFU = tokens/s x FLOPs/token / (GPUs x peak dense bf16 FLOP/s). FLOPs/token, per convention:

    mfu       6 N' + 12 L T d   PaLM (appendix B), nanoGPT, torchtitan: attention QK^T and AV, forward
                                2 x 2 T d per token and layer, x 3 with backward. The headline number.
    mfu_6ltd  6 N' + 6 L T d    Kaplan et al. 2020 / llm.c: half the attention term.

N' = the parameters a token's matmuls touch: every weight except the input embedding (a lookup), plus
the output head once (tied or not). L = n_layers, T = seq_len, d = n_heads x head_dim. The causal mask
is not discounted, as is conventional.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from training.model.decoder import ModelConfig, count_params
from training.runfiles.json_records import RecordError, read_log
from training.telemetry.tracking import open_tracker

ATTN_PALM, ATTN_KAPLAN = 12, 6  # attention FLOPs per token, layer, position and d: the two conventions
MFU_KEYS: dict[str, int] = {"mfu": ATTN_PALM, "mfu_6ltd": ATTN_KAPLAN}  # log key -> attention factor


def matmul_params(cfg: ModelConfig) -> int:
    """N': the weights a token multiplies through. The embedding table is a lookup, not a matmul;
    the output head is one, counted once whether or not it shares the embedding's storage."""
    return count_params(cfg, non_embedding=True) + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int, attn_factor: int = ATTN_PALM) -> float:
    """Training (forward + backward) FLOPs per token: 6 N' + attn_factor x L x T x d (module docstring)."""
    return 6.0 * matmul_params(cfg) + float(attn_factor) * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim


def mfu_flops(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """FLOPs/token under each MFU convention, keyed by its log.jsonl name (MFU_KEYS)."""
    return {key: flops_per_token(cfg, seq_len, factor) for key, factor in MFU_KEYS.items()}


# Dense (no sparsity) bf16 tensor-core peak FLOP/s per GPU. Sources: NVIDIA data sheets, which print
# the sparse figure with "*"; dense = half of it. H100/H200 (SXM5, NVL, PCIe): "NVIDIA H100 Tensor Core
# GPU" and "NVIDIA H200 Tensor Core GPU" data sheets (BF16 1,979* SXM, 1,671* NVL, 1,513* PCIe);
# GH200: Grace Hopper data sheet; B200 / GB200: HGX B200 and GB200 NVL72 specs (4.5 / 5 PF* per GPU);
# A100 (SXM4 and PCIe): A100 data sheet (624*); L40S: 362.05 | 733*; L40: 181.05 | 362.1*; L4: 242*;
# A10: 250*; RTX 4090: Ada whitepaper (165.2 | 330.3*, FP32 accumulate). Others (A10G, consumer
# Ampere) are left out rather than guessed: an unknown GPU reports no MFU instead of a wrong one.
# A key is the name's words: a device matches when its name holds all of them (whole words, any
# case); the key with the most words wins ("H200 NVL" over "H200"). The SXM parts report no form
# factor in their names ("NVIDIA H100 80GB HBM3", "NVIDIA H200"), so the bare model is the SXM part.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989.4e12,  # SXM (1,979* / 2, as usually quoted)
    "H200 NVL": 835.5e12,
    "H100": 989.4e12,  # SXM5
    "H100 NVL": 835.5e12,
    "H100 PCIe": 756.5e12,
    "GH200": 989.4e12,
    "B200": 2250e12,
    "GB200": 2500e12,
    "A100": 312.0e12,
    "L40S": 362.05e12,
    "L40": 181.05e12,
    "L4": 121.0e12,
    "A10": 125.0e12,
    "RTX 4090": 165.2e12,
}


def _words(name: str) -> set[str]:
    return set(re.findall(r"[A-Z0-9]+", name.upper()))


def lookup_by_name(name: str, table: Mapping[str, float]) -> float | None:
    """table's value for a device named like torch.cuda.get_device_name(): the key whose words the name
    holds, the most specific (most words) first; None when no key matches."""
    words = _words(name)
    matches = [k for k in table if _words(k) <= words]
    return table[max(matches, key=lambda k: len(_words(k)))] if matches else None


def peak_flops_for_name(name: str) -> float | None:
    """The dense bf16 peak of a GPU named like torch.cuda.get_device_name(); None when not in the table."""
    return lookup_by_name(name, PEAK_BF16_FLOPS)


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak bf16 FLOP/s, GPU name) for a CUDA device; (None, name) when unknown or not CUDA."""
    if device.type != "cuda":
        return None, device.type
    name = torch.cuda.get_device_name(device)
    return peak_flops_for_name(name), name


def fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def is_eval_record(record: Mapping) -> bool:
    """A step record that carries a validation result (the trainer merges validate() into it)."""
    return "val_loss" in record


class StepLog:
    """RUN_DIR/log.jsonl: one JSON record per optimizer step (and eval/event records).

    Every record the trainer logs passes through write(), so this is also where the run becomes
    watchable: RUN_DIR/curves.png is redrawn after each evaluation record (and once at close), and
    with log_to="tensorboard" each record's numbers go to RUN_DIR/tensorboard/ as well. Rank 0 only:
    other ranks construct it with enabled=False and it does nothing."""

    def __init__(self, path: Path, enabled: bool = True, log_to: str = "", curves: bool = True):
        self.path, self.enabled = Path(path), enabled
        self.curves = curves and enabled
        self._undrawn = False  # records written since curves.png was last drawn
        self._curves_failed = False
        self.tracker = open_tracker(log_to, self.path.parent) if enabled else None  # bad log_to fails here, early
        self._f = open(self.path, "a", encoding="utf-8") if enabled else None  # noqa: SIM115 (held for the run)

    def truncate_after(self, step: int) -> None:
        """On resume: drop records past the checkpoint so the log continues exactly."""
        if not self.enabled or not self.path.exists():
            return
        self._f.close()
        keep = []
        try:
            for rec in read_log(self.path):  # a torn last line is left out, so the log continues whole
                if isinstance(rec.value.get("step", 0), int) and rec.value.get("step", 0) <= step:
                    keep.append(json.dumps(rec.value, ensure_ascii=False))  # as write() wrote it
        except RecordError as e:  # damage mid-log: keep what precedes it; the log must not stop a resume
            print(f"warning: {e}; the log continues from the records before it", file=sys.stderr)
        tmp = self.path.with_name(self.path.name + ".tmp")  # atomic: a crash here must not lose the log
        tmp.write_text("".join(k + "\n" for k in keep), encoding="utf-8")
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict) -> None:
        if not self._f:
            return
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        self._undrawn = True
        if self.tracker is not None:
            self.tracker.log(record)
        if is_eval_record(record):
            self.draw()

    def draw(self) -> None:
        """Redraw curves.png from the log. A plot that cannot be drawn (disk full, a broken backend)
        is worth one warning, never the run: training goes on without it."""
        if not self.curves or self._curves_failed:
            return
        from training.telemetry.curves import draw_curves

        try:
            draw_curves(self.path.parent)
            self._undrawn = False
        except (OSError, ValueError, RuntimeError) as e:
            self._curves_failed = True
            print(f"warning: {self.path.parent}: curves not drawn ({e}); training continues", file=sys.stderr)

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None
            if self._undrawn:  # the last steps after the last evaluation (or a run without any)
                self.draw()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


class Throughput:
    """Tokens/s over a sliding window of recent steps, MFU (each convention of MFU_KEYS), ETA and cost.

    `flops_per_token` is one number (reported as "mfu") or mfu_flops()'s {log key: FLOPs/token}."""

    def __init__(self, flops_per_token: float | Mapping[str, float], peak: float | None, n_gpus: int,
                 hourly_usd: float, window: int = 20, elapsed_before: float = 0.0):
        self.flops = dict(flops_per_token) if isinstance(flops_per_token, Mapping) else {"mfu": flops_per_token}
        self.fpt = self.flops["mfu"]
        self.peak, self.n_gpus, self.hourly = peak, n_gpus, hourly_usd
        self.window = window
        self.samples: list[tuple[float, int]] = []
        self.start = time.perf_counter()
        self.elapsed_before = elapsed_before  # from earlier segments of a resumed run

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

    def mfu_of(self, key: str) -> float | None:
        if self.peak is None or not math.isfinite(self.tokens_per_s):
            return None
        return self.tokens_per_s * self.flops[key] / (self.peak * self.n_gpus)

    @property
    def mfu(self) -> float | None:
        """MFU in the headline (12 L T d) convention when given mfu_flops(), else of the one number given."""
        return self.mfu_of("mfu")

    def mfu_fields(self) -> dict[str, float | None]:
        """{log key: MFU} for every convention this was given: what a step record carries."""
        return {key: self.mfu_of(key) for key in self.flops}

    def cost(self, seconds: float) -> float:
        return seconds / 3600 * self.hourly * self.n_gpus

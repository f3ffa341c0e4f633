"""MetricsLogger: RUN_DIR/log.jsonl (with --log-to tracking and curves.png, training.telemetry.step_metrics.StepLog),
the run's token count and clock (kept in every checkpoint), throughput and MFU, the progress line."""

from __future__ import annotations

import math

import torch

from training import distributed as D
from training.config_sections import MetricsSection
from training.loop.step import ModelViews, StepResult, TrainStep
from training.model.decoder import ModelConfig, count_params
from training.run_context import RunContext
from training.runfiles import layout
from training.telemetry.step_metrics import StepLog, Throughput, fmt_duration, mfu_flops, peak_flops
from training.telemetry.tracking import open_tracker
from training.train_config import ConfigError


def _num(x: float) -> float | None:
    return round(x, 2) if math.isfinite(x) else None


class EventLog:
    """The run's event records (not steps'), the RunContext's `log`: every component writes through it
    from the start, and records met before log.jsonl is open (a --reset-optimizer resume) wait here."""

    def __init__(self) -> None:
        self.log: StepLog | None = None
        self.queued: list[dict] = []

    def __call__(self, rec: dict) -> None:
        if self.log is None:
            self.queued.append(rec)
        else:
            self.log.write(rec)

    def open(self, log: StepLog) -> None:
        """log.jsonl is open: the events queued so far written, in order, and the next ones at once."""
        self.log = log
        for rec in self.queued:
            log.write(rec)
        self.queued = []


class MetricsLogger:
    def __init__(self, section: MetricsSection, ctx: RunContext):
        self.cfg, self.ctx, self.out, self.dist, self.device = section, ctx, ctx.out, ctx.dist, ctx.device
        self.log: StepLog | None = None  # opened by open(), once the run folder is committed
        self.throughput: Throughput | None = None  # started by start(), when the first step is
        self.tokens = 0
        self.elapsed_before = 0.0  # seconds spent in earlier sessions of a resumed run
        self.last_record: dict | None = None
        # dense bf16 peak FLOP/s of the device (None: unknown, CPU), and the name the banner says
        self.peak_flops, self.device_name = peak_flops(ctx.device)

    def check_tracker(self) -> None:
        """--log-to: its package is there (nothing is opened or written yet)."""
        if self.cfg.log_to:
            try:
                open_tracker(self.cfg.log_to, self.out)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def banner(self, model_cfg: ModelConfig, step: TrainStep, views: ModelViews) -> str:
        """The run's first line: size, devices, tokens per step, steps, parallelism."""
        cfg, d = self.cfg, self.dist
        mesh = D.mesh_shape(d.world_size, d.local_world_size)
        mode = ("single process" if not d.enabled else "DDP" if not cfg.fsdp else "FSDP2" if len(mesh) == 1
                else f"FSDP2 (HSDP {mesh[0]}x{mesh[1]}: replicated across nodes, sharded within one)")
        if d.enabled and cfg.fsdp and views.fsdp_param_dtype is not None:
            mode += ", bf16 all-gathers and compute, fp32 gradient reduction"
        return (f"prodip {self.ctx.kind}: {count_params(model_cfg) / 1e6:.1f} M params "
                f"({count_params(model_cfg, non_embedding=True) / 1e6:.1f} M non-embedding), {d.world_size}x "
                f"{self.device_name}, {step.tokens_per_step:,} tokens/step, {step.total_steps:,} steps, {mode}")

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        elapsed = self.throughput.elapsed if self.throughput is not None else self.elapsed_before
        return {"tokens": self.tokens, "elapsed_s": elapsed}

    def load_state_dict(self, state: dict) -> None:
        self.tokens = state["tokens"]
        elapsed = state.get("elapsed_s", 0.0)
        self.elapsed_before = float(elapsed) if isinstance(elapsed, int | float) else 0.0

    # -------------------------------------------------------------------------------- the log
    def open(self, step: int) -> None:
        """log.jsonl, its records past `step` dropped (0 for a fresh run: an attempt that never saved),
        then the events queued before it was open (the context's EventLog)."""
        log_to = {"log_to": self.cfg.log_to} if self.cfg.log_to else {}
        self.log = StepLog(self.out / layout.LOG, enabled=self.dist.is_main, **log_to)
        self.log.truncate_after(step)
        if isinstance(self.ctx.log, EventLog):  # a context built without one (a test) drops its events
            self.ctx.log.open(self.log)

    def write(self, rec: dict) -> None:
        """A step's record (the newest is the summary's final loss)."""
        self.log.write(rec)
        self.last_record = rec

    def close(self) -> None:
        if self.log is not None:
            self.log.close()

    # ------------------------------------------------------------------------------ the clock
    def start(self, model_cfg: ModelConfig) -> None:
        """The clock starts here: tokens/s and elapsed_s measure training steps, not set-up and gates."""
        if self.device.type == "cuda":  # peak_mem_gb in log.jsonl: the training steps' peak, not the gates'
            torch.cuda.reset_peak_memory_stats(self.device)
        self.throughput = Throughput(mfu_flops(model_cfg, self.cfg.seq_len), self.peak_flops, self.dist.world_size,
                                     self.cfg.gpu_hourly_usd, elapsed_before=self.elapsed_before)
        self.throughput.update(self.tokens)

    def count(self, tokens: int) -> dict:
        """A step's tokens (a dropped batch's count too) and the host side of its record, taken now."""
        self.tokens += tokens
        thr = self.throughput
        thr.update(self.tokens)
        out = {"tokens": self.tokens, "tokens_per_s": _num(thr.tokens_per_s), **thr.mfu_fields(),
               "elapsed_s": round(thr.elapsed, 3)}
        if self.device.type == "cuda":
            out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        return out

    @staticmethod
    def record(r: StepResult) -> dict:
        """The step's log.jsonl record (validation is added by the loop)."""
        rec = {"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, **r.fields}
        if r.spike_z:
            rec["loss_spike_z"] = r.spike_z
        return rec

    def should_print(self, step: int, *, first: bool, last: bool) -> bool:
        return step % self.cfg.log_every == 0 or first or last

    def progress_line(self, rec: dict, step: int, total: int, val: dict | None) -> str:
        thr = self.throughput
        tps = rec["tokens_per_s"] or float("nan")
        remaining = (total - step) * (thr.elapsed / max(step, 1)) if step else float("nan")
        parts = [f"step {step}/{total}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}",
                 f"gnorm {rec['grad_norm']:.2f}", f"{tps:,.0f} tok/s"]
        if rec["mfu"] is not None:
            parts.append(f"MFU {rec['mfu'] * 100:.1f}%")
        if val:
            parts.append(f"val {val['val_loss']:.4f}" + (f" ({val['val_bpb']:.3f} bpb)" if "val_bpb" in val else ""))
        parts.append(f"ETA {fmt_duration(remaining)}")
        if thr.hourly:
            parts.append(f"${thr.cost(thr.elapsed):.2f} so far, ${thr.cost(thr.elapsed + remaining):.2f} projected")
        return " | ".join(parts)

    def summary(self, step: int) -> dict:
        elapsed = self.throughput.elapsed if self.throughput is not None else self.elapsed_before
        return {"step": step, "tokens": self.tokens, "elapsed_s": elapsed, "run_dir": str(self.out),
                "final_loss": self.last_record["loss"] if self.last_record else None}

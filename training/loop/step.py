"""The one training step: what the Trainer runs, and what scripts/gpu_validate.py and
tests/benchmarks/bench_train.py time (same wrapping, autocast, chunked loss, clipping, optimizer).

ModelViews holds the model in its three views, because each job needs another:
    `model`          the Transformer: named parameters, its config, what a checkpoint holds
    `wrapped`        after DDP/FSDP2 (`model` itself single-process and under FSDP2, whose
                     parameters are then sharded DTensors): gradient sync, clipping, full state dicts
    `forward_model`  what a step calls: `wrapped`, whose blocks --compile compiled in place before
                     wrapping (training.distributed.compile_blocks); in one process under bf16 autocast
                     a CastOnce around it (training.loop.weight_cast: the block matrices cast to bf16
                     once per optimizer step, not once per micro-batch); the gates call it too
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from training import distributed as D
from training import gates, optim
from training.config_sections import StepSection
from training.data.loaders import Batch
from training.gates.runtime import first_nonfinite_index
from training.loop.weight_cast import CastOnce
from training.model.decoder import Transformer
from training.schedule import lr_at
from training.train_config import ConfigError

Autocast = Callable[[], contextlib.AbstractContextManager]


class BatchSource(Protocol):
    def next_batch(self, batch_size: int) -> Batch: ...

    def state_dict(self) -> dict: ...


class RepeatBatch:
    """One batch handed out at every draw (a loader's interface): what a benchmark times the step on."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.batch = (x, y)

    def next_batch(self, batch_size: int) -> Batch:
        return self.batch

    def state_dict(self) -> dict:
        return {}


def pick_device(name: str, d: D.Dist) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name} but no CUDA device is available")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda", d.local_rank) if name == "cuda" else torch.device(name)
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps but MPS is not available")
    return torch.device(name)


def autocast_for(cfg: StepSection, device: torch.device) -> Autocast:
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    if use_bf16:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def to_device(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A host batch on the device: through pinned memory without blocking on CUDA (the host goes on
    queueing work while it copies); tensors already there pass through."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    mask = batch[2] if len(batch) > 2 else None
    return move(batch[0]), move(batch[1]), None if mask is None else move(mask)


@dataclass
class ModelViews:
    model: Transformer
    wrapped: torch.nn.Module
    forward_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Autocast
    device: torch.device
    fsdp_param_dtype: torch.dtype | None = None
    trainable: list[tuple[str, torch.nn.Parameter]] = field(init=False)

    def __post_init__(self) -> None:
        self.trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]


def build_views(model: Transformer, cfg: StepSection, d: D.Dist, device: torch.device,
                new_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None) -> ModelViews:
    """`model` (built on the CPU) moved to `device`, its blocks compiled with --compile, wrapped for
    DDP/FSDP2, and its optimizer (training.optim.make_optimizer unless `new_optimizer` is given)."""
    model.activation_checkpointing = cfg.activation_checkpointing
    model.to(device)
    if cfg.compile:  # per block, before wrapping: the wrappers then never split the graph
        D.compile_blocks(model)
    autocast = autocast_for(cfg, device)
    with autocast():  # bf16 compute: FSDP2 gathers bf16 weights and reduces gradients in fp32
        param_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    wrapped = D.wrap(model, d, fsdp=cfg.fsdp, device=device, param_dtype=param_dtype,
                     reshard_after_forward=cfg.fsdp_reshard_after_forward)
    opt = (new_optimizer or (lambda m: optim.make_optimizer(m, cfg, device)))(wrapped)
    forward = wrapped
    # one process in bf16: weights cast once per step (activation checkpointing recomputes each block after
    # the step's call has returned, from the parameters themselves: nothing to reuse there)
    if param_dtype is not None and not d.enabled and not cfg.activation_checkpointing:
        forward = CastOnce(wrapped, param_dtype)
    return ModelViews(model, wrapped, forward, opt, autocast, device, param_dtype)


@dataclass
class StepResult:
    """One optimizer step: what the runtime checks judge and the log records. `loss`, `grad_norm` (and
    `first_bad`) are device tensors until training.loop.step_reads reads them, then Python numbers."""

    step: int
    lr: float
    loss: torch.Tensor | float  # mean over micro-batches and ranks
    grad_norm: torch.Tensor | float  # before clipping
    position: dict  # the data position the step started from (for the non-finite diagnostic)
    deferred: bool = False  # update applied on the device before the values were read (a non-finite one skipped)
    nonfinite: torch.Tensor | None = None  # deferred: 1.0 when loss or norm is not finite (the device's skip flag)
    first_bad: torch.Tensor | int | None = None  # deferred: index of the first non-finite gradient, -1 if none
    fields: dict = field(default_factory=dict)  # the record's host fields, taken at the step (tokens, timing)
    applied: bool | None = None  # did the update reach the weights: None until judged
    spike_z: float | None = None


def total_steps(cfg: StepSection, d: D.Dist) -> int:
    """The run's optimizer steps: --max-steps, else --max-tokens over the tokens each step takes."""
    return cfg.max_steps or math.ceil(cfg.max_tokens / tokens_per_step(cfg, d))


def tokens_per_step(cfg: StepSection, d: D.Dist) -> int:
    return cfg.batch_size * cfg.grad_accum * cfg.seq_len * d.world_size


class TrainStep:
    """Forward/backward over grad_accum micro-batches, gradients clipped; then the update, applied now
    (`apply`, after the host judged the values) or on the device without a host read (`apply_deferred`:
    fused AdamW skips a non-finite update itself)."""

    def __init__(self, views: ModelViews, cfg: StepSection, d: D.Dist, lr_schedule: optim.Schedule = lr_at,
                 on_first_update: Callable[[ModelViews], None] | None = None):
        self.views, self.cfg, self.dist, self.lr_schedule = views, cfg, d, lr_schedule
        # called once, after the first update this process applies (the optimizer's moments exist then):
        # the Trainer's checkpointer allocates its save buffers there (Checkpointer.reserve)
        self.on_first_update = on_first_update
        self.total_steps = total_steps(cfg, d)
        # fused AdamW skips a non-finite update on the device, so values can wait for the next read
        self.deferrable = optim.uses_fused(cfg, views.device) and not (cfg.fsdp and d.enabled)
        self.tokens_per_step = tokens_per_step(cfg, d)

    def compute(self, step: int, batches: BatchSource, *, read_now: bool) -> StepResult:
        """Gradients accumulated and clipped, not yet applied. Loss and grad norm stay on the device."""
        cfg, d, v = self.cfg, self.dist, self.views
        lr = optim.lr_for_step(cfg, step, self.total_steps, self.lr_schedule)
        optim.set_lr(v.optimizer, lr)
        position = batches.state_dict()
        loss_sum = torch.zeros((), device=v.device)
        hold = getattr(v.forward_model, "hold", contextlib.nullcontext)  # CastOnce: one cast per step
        with hold():
            for micro in range(cfg.grad_accum):
                x, y, mask = to_device(batches.next_batch(cfg.batch_size), v.device)
                sync = D.grad_sync(v.wrapped, d, fsdp=cfg.fsdp, last_micro=micro == cfg.grad_accum - 1)
                with sync:  # entered once: DDP's no_sync() cannot be re-entered
                    with v.autocast():
                        _, loss = v.forward_model(x, y, loss_mask=mask)  # the loss alone: no logits
                    (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach()
        loss = d.mean(loss_sum / cfg.grad_accum)
        # a non-finite norm leaves the gradients as they are, for the diagnostic to name the parameter
        norms: list[torch.Tensor] = []  # per-gradient norms, shared with first_nonfinite_index below
        norm = gates.clip_grad_norm_finite(v.wrapped.parameters(), cfg.grad_clip, norms_out=norms)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        r = StepResult(step, lr, loss, norm, position)
        if not read_now:  # what the device-side skip and a later diagnostic need
            r.nonfinite = (~(torch.isfinite(loss) & torch.isfinite(norm))).float()
            r.first_bad = first_nonfinite_index(v.trainable, norms[0] if norms else None)
        return r

    def apply(self, r: StepResult) -> None:
        """The update of a step whose values were read: applied when the checks let it through."""
        if r.applied:
            self.views.optimizer.step()
            self._first_update()
        self.views.optimizer.zero_grad(set_to_none=True)

    def apply_deferred(self, r: StepResult) -> None:
        r.deferred = True
        optim.step_unless(self.views.optimizer, r.nonfinite)
        self._first_update()
        self.views.optimizer.zero_grad(set_to_none=True)

    def _first_update(self) -> None:
        hook, self.on_first_update = self.on_first_update, None
        if hook is not None:
            hook(self.views)

    def timed(self, step: int, batches: BatchSource) -> torch.Tensor:
        """One whole step as a benchmark times it (no runtime checks): deferred where the run defers, else
        the update applied without a read. Returns the loss (a device tensor)."""
        r = self.compute(step, batches, read_now=not self.deferrable)
        if self.deferrable:
            self.apply_deferred(r)
        else:
            r.applied = True
            self.apply(r)
        return r.loss

"""The optimizer (AdamW), the learning rate each step takes from training.schedule, and RNG state.

RNG state is saved with every checkpoint (as tensors, in optim.safetensors) so a resumed run draws
what the uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from training.config_sections import StepSection
from training.schedule import lr_at
from training.train_config import TrainConfig

Schedule = Callable[..., float]  # lr_at's signature: (step, *, max_lr, total, warmup, schedule, min_ratio, decay_frac)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig | StepSection, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D params). The fused kernel on CUDA (--fused-optimizer auto)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if uses_fused(cfg, device) else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, **extra)


def uses_fused(cfg: TrainConfig | StepSection, device: torch.device) -> bool:
    """Fused AdamW: on CUDA by default; elsewhere only when asked (on CPU it rounds differently from the
    for-loop AdamW that CPU runs have always used)."""
    return cfg.fused_optimizer == "on" or (cfg.fused_optimizer == "auto" and device.type == "cuda")


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """optimizer.step(), which the fused kernel turns into a no-op on the device when `found_inf` (a
    0-d float tensor, 1.0 = skip) is set: parameters, moments and step counts stay untouched, and the
    host never waits for the flag (the GradScaler mechanism, without a scaler)."""
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def lr_for_step(cfg: TrainConfig | StepSection, step: int, total_steps: int, schedule: Schedule = lr_at) -> float:
    """The learning rate of optimizer step `step` (1-based) under cfg's schedule."""
    return schedule(step, max_lr=cfg.lr, total=total_steps, warmup=cfg.warmup_steps, schedule=cfg.schedule,
                    min_ratio=cfg.min_lr_ratio, decay_frac=cfg.decay_frac)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in rng:
        torch.cuda.set_rng_state(rng["torch_cuda"], device)

"""Learning-rate schedules: linear warmup, then cosine, WSD (warmup-stable-decay) or constant."""

from __future__ import annotations

import math


def lr_at(step: int, *, max_lr: float, total: int, warmup: int, schedule: str, min_ratio: float,
          decay_frac: float = 0.2) -> float:
    """LR for optimizer step `step` (1-based)."""
    min_lr = max_lr * min_ratio
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if schedule == "constant":
        return max_lr
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":  # stable at max_lr, then linear decay over the last decay_frac of steps
        decay_start = total - int(decay_frac * total)
        if step <= decay_start:
            return max_lr
        return max_lr - (max_lr - min_lr) * (step - decay_start) / max(1, total - decay_start)
    raise ValueError(f"unknown schedule {schedule!r}")

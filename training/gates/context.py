"""The pre-flight context: everything a gate may look at, typed.

The torch and training types are named for type checkers only, so importing the context (as the
package's `__init__` does) pulls no torch: prepare and export import this package for its results.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from training.data.loaders import TrainingData
    from training.distributed import Dist
    from training.model.decoder import ModelConfig, Transformer
    from training.train_config import TrainConfig


@dataclass
class PreflightContext:
    """Everything a pre-flight gate may look at. `model` is the exact object that trains (after
    DDP/FSDP2 wrapping and torch.compile); `raw_model` the Transformer underneath it."""

    model: nn.Module
    raw_model: Transformer
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer]  # the run's own: the overfit gate's optimizer
    batches: TrainingData  # the loader (read through its own next_batch, state restored), val, tokenizer, report
    cfg: TrainConfig
    model_cfg: ModelConfig
    device: torch.device
    autocast: Callable[[], AbstractContextManager[Any]]  # the run's autocast (or a null context)
    dist: Dist
    flops_per_token: float
    peak_flops: float | None  # dense bf16 peak FLOP/s of the device; None where unknown (CPU)

"""torchrun integration: process group, DDP/FSDP2 wrapping, full (unsharded) state dicts.

Single process when torchrun's WORLD_SIZE is absent or 1. Checkpoints always hold the full model
and optimizer state keyed by parameter name (torch.distributed.checkpoint's state-dict API), so a
run saved under DDP or FSDP2 resumes under any world size and the single-process exporter reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.AVG if t.device.type == "cuda" else dist.ReduceOp.SUM)
            if t.device.type != "cuda":  # gloo has no AVG
                t /= self.world_size
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)


def setup(device_kind: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend=backend)
    return Dist(rank, local, world)


def teardown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, d: Dist, *, fsdp: bool, device: torch.device) -> nn.Module:
    """DDP (default) or FSDP2 (`fully_shard` per block, then the root) under torchrun."""
    if not d.enabled:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{'state': {param_name: {...}}, 'param_groups': [{..., 'params': [names]}]}."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict, optim_sd: dict | None) -> None:
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=opts)
    if optimizer is not None and optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))

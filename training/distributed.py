"""torchrun integration: process group, DDP/FSDP2 wrapping, full (unsharded) state dicts.

Single process when torchrun's WORLD_SIZE is absent or 1. Under torchrun (one process per GPU,
or per CPU worker with the gloo backend) the model is wrapped in DDP by default, or sharded with
FSDP2 (`fully_shard` per transformer block, then the root) with `--fsdp`. Checkpoints always hold the
full model and optimizer state keyed by parameter name (torch.distributed.checkpoint's state-dict
API), so a run saved under DDP or FSDP2 resumes under any world size and the single-process
exporter reads it.

Collectives: every function here that gathers (`full_model_state`, `full_optimizer_state`,
`load_full_state`, `Dist.mean/any/ranks_where`) must be called by every rank in the same order.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

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

# torchrun's default (10 min) is too short for a first torch.compile of a large model on one rank
# while the others wait in a collective; a real hang still ends, after this long.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)


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
        """The mean of `t` over ranks (every rank gets it)."""
        if self.enabled:
            t = t.detach().clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)  # SUM then divide: gloo has no AVG
            t /= self.world_size
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when `flag` is true on at least one."""
        return bool(self.ranks_where(flag, device))

    def ranks_where(self, flag: bool, device: torch.device) -> list[int]:
        """The ranks where `flag` is true (every rank gets the same list)."""
        if not self.enabled:
            return [0] if flag else []
        t = torch.zeros(self.world_size, device=device)
        t[self.rank] = 1.0 if flag else 0.0
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [r for r in range(self.world_size) if t[r].item() > 0]


def setup(device_kind: str) -> Dist:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); a no-op outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local)
        # device_id binds the NCCL communicator to this GPU eagerly (no guessing from the rank)
        dist.init_process_group(backend="nccl", timeout=PROCESS_GROUP_TIMEOUT,
                                device_id=torch.device("cuda", local))
    else:
        dist.init_process_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
    return Dist(rank, local, world)


def teardown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, d: Dist, *, fsdp: bool, device: torch.device) -> nn.Module:
    """DDP (default) or FSDP2 (`fully_shard` per block, then the root) under torchrun.

    FSDP2 shards the parameters in place: the returned object *is* `model`, whose parameters are
    now DTensors (`p.full_tensor()` gathers one; a collective). DDP returns a wrapper whose
    `.module` is `model`, with ordinary parameters.
    """
    if not d.enabled:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # Blocks return their (k, v) for the KV cache next to the hidden state; training never
        # touches them in place, so FSDP2's warning about returning views does not apply.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh(device.type, (d.world_size,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root: embeddings (tied to the head) and the final norm
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def grad_sync(model: nn.Module, d: Dist, *, fsdp: bool, last_micro: bool):
    """Context for one micro-batch's forward+backward: reduce gradients only on the last one of
    a gradient-accumulation step (DDP `no_sync`, FSDP2 `set_requires_gradient_sync`)."""
    import contextlib

    if not d.enabled:
        return contextlib.nullcontext()
    if fsdp:
        model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last_micro else model.no_sync()


def full_model_state(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full, unsharded weights keyed by parameter name ('module.'/'_orig_mod.' prefixes removed).

    A collective under FSDP2. By default every rank gets the full tensors on the model's device (the
    pre-flight gates build reference models from them); `rank0_only` gathers to CPU on rank 0 and
    returns {} elsewhere (checkpoint saving: no extra GPU memory, one copy)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, rank0_only: bool = True) -> dict:
    """{'state': {param_name: {...}}, 'param_groups': [{..., 'params': [names]}]}; a collective under
    FSDP2. On CPU and only on rank 0 by default (the checkpoint writer's use); {} on other ranks."""
    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict,
                    optim_sd: dict | None) -> None:
    """Load full (unsharded) weights and optimizer state on every rank; FSDP2 keeps its shard of each.

    `weights` may lack the tied output head (the checkpoint stores it once, as tok_embeddings)."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    if optimizer is not None and optim_sd:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))

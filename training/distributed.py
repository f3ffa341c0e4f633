"""torchrun integration: process group, DDP/FSDP2/HSDP wrapping, full (unsharded) state dicts,
and the one resume decision every rank shares.

Single process outside torchrun. Under torchrun (one process per GPU, or per CPU worker with the gloo
backend; with --nproc_per_node=1 too: a one-rank process group, so one GPU runs the very code path of
many, FSDP2 and its sharded checkpoints included) the model is wrapped in DDP by default, or sharded with
FSDP2 (`fully_shard` per transformer block, then the root) with `--fsdp`: on one node a flat mesh,
on several (LOCAL_WORLD_SIZE < WORLD_SIZE) an HSDP 2-D mesh that shards within a node (NVLink) and
replicates across nodes (the slower network carries only one gradient all-reduce per step).
Checkpoints hold the model and optimizer state keyed by parameter name: gathered whole to rank 0
(torch.distributed.checkpoint's state-dict API, `full_model_state`), or under FSDP2 by default each
rank's own shards (training.checkpoint.fsdp_shards, no collective; training.checkpoint.checkpoint_io reassembles
them). Either way a run resumes under any world size and the single-process exporter reads it; on
resume rank 0 alone reads it and broadcasts one tensor at a time (`load_full_state`), so no other
rank holds the full state in RAM.

Where to resume from is rank 0's decision (`agree_on_view`): each rank reads the run folder, rank 0
broadcasts what it found (the checkpoint's step and a fingerprint of its state.json), and a rank
that sees another folder (a node without the shared file system) stops every rank with one line,
instead of node 0 resuming while the others start fresh into mismatched collectives.

Collectives: every function here that gathers (`full_model_state`, `full_optimizer_state`,
`load_full_state`, `agree_on_view`, `Dist.mean/any/ranks_where/raise_if_any`) must be called by
every rank in the same order.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
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
    local_world_size: int = 0  # ranks on this node (torchrun's LOCAL_WORLD_SIZE); 0: all of them
    group: bool = False  # a process group exists (torchrun), even of one rank

    @property
    def enabled(self) -> bool:
        """Under torchrun (a process group, of any size, this one included): collectives, DDP/FSDP2."""
        return self.world_size > 1 or self.group

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

    def raise_if_any(self, error: BaseException | None, device: torch.device, what: str) -> None:
        """Raise on every rank when any rank met an error: its own there, a pointer to it elsewhere.
        Call it after per-rank work that may fail and before the next collective (a rank that raised
        alone would leave the others waiting in that collective until the timeout)."""
        failed = self.ranks_where(error is not None, device)
        if error is not None:
            raise error
        if failed:
            raise DistError(f"rank(s) {failed} failed while {what}; see their error")

    def broadcast_ints(self, values: list[int], device: torch.device) -> list[int]:
        """Rank 0's `values` on every rank (every rank passes a list of the same length)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return [int(v) for v in t.tolist()]


class DistError(RuntimeError):
    """Ranks disagree (another rank failed, or sees another run folder): every rank raises it."""


@dataclass(frozen=True)
class RunView:
    """What one rank found in the run folder: where it would resume from, and how."""

    step: int = -1  # the checkpoint's step; -1: none (a fresh start)
    fingerprint: str = ""  # sha256 (hex) of that checkpoint's state.json
    start_over: bool = False  # --force over a run with another model config
    stopped: bool = False  # early-stopped before: nothing to do

    def encode(self) -> list[int]:
        sha = bytes.fromhex(self.fingerprint) if self.fingerprint else bytes(FINGERPRINT_BYTES)
        return [self.step, int(self.start_over), int(self.stopped), *sha]

    @classmethod
    def decode(cls, v: list[int]) -> RunView:
        step, start_over, stopped, sha = v[0], bool(v[1]), bool(v[2]), bytes(v[3:])
        return cls(step, sha.hex() if step >= 0 else "", start_over, stopped)

    def describe(self) -> str:
        if self.step < 0:
            return "no checkpoint (a fresh start)" + (" over another run (--force)" if self.start_over else "")
        return f"checkpoint step {self.step} (state.json sha256 {self.fingerprint[:12]})"


FINGERPRINT_BYTES = 32  # sha256


def agree_on_view(d: Dist, mine: RunView, device: torch.device, where: str) -> RunView:
    """Rank 0's view of the run folder, which every rank must share; DistError on every rank if not.

    Only rank 0 writes the run folder, so every rank must see rank 0's files: a rank with no
    checkpoint (or another one) while rank 0 resumes is a node without the shared file system."""
    if not d.enabled:
        return mine
    ref = RunView.decode(d.broadcast_ints(mine.encode(), device))
    differ = d.ranks_where(mine != ref, device)
    if differ:
        own = f"; this rank (rank {d.rank}) sees {mine.describe()}" if mine != ref else ""
        raise DistError(f"rank(s) {differ} do not see the run folder rank 0 sees at {where} (rank 0: "
                        f"{ref.describe()}){own}: every node must see the same --out (a shared file system)")
    return ref


def under_torchrun() -> bool:
    """torchrun (its elastic agent) started this process: it sets what init_process_group's env:// reads."""
    return all(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "RANK", "MASTER_ADDR", "MASTER_PORT"))


def setup(device_kind: str) -> Dist:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU), also a one-rank one; a no-op outside
    torchrun (and for WORLD_SIZE 1 set by hand without torchrun's other variables)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not under_torchrun():
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device_kind == "cuda":
        torch.cuda.set_device(local)
        # device_id binds the NCCL communicator to this GPU eagerly (no guessing from the rank)
        dist.init_process_group(backend="nccl", timeout=PROCESS_GROUP_TIMEOUT,
                                device_id=torch.device("cuda", local))
    else:
        dist.init_process_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
    return Dist(rank, local, world, local_world, group=True)


def teardown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def mesh_shape(world_size: int, local_world_size: int) -> tuple[int, ...]:
    """FSDP2's device-mesh shape: (world,) on one node; (nodes, ranks per node) on several (HSDP:
    replicate across nodes, shard within one). Uneven nodes (torchrun never makes them) stay flat."""
    local = local_world_size or world_size
    if local >= world_size or world_size % local:
        return (world_size,)
    return (world_size // local, local)


def device_mesh(d: Dist, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(d.world_size, d.local_world_size)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each transformer block in place (`Module.compile`), before any DDP/FSDP2 wrapping,
    as torchtitan does: the wrappers' hooks and collectives stay outside the compiled code, so neither
    splits the graph (no DDP bucket splitting, no graph break at each `fully_shard` boundary), and the
    blocks share one graph (same code, parameters as inputs). Names and state dicts are unchanged.
    The loss's per-chunk softmax is compiled too where that pays (training.model.decoder.COMPILE_LOSS_DEVICES)."""
    for layer in model.layers:
        layer.compile()
    model.compile_loss = True


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Compiled blocks run their eager code here: another grad mode (validation under no_grad) or
    another shape (the overfit gate's 2 rows) would otherwise compile a second graph mid-run."""
    with torch.compiler.set_stance("force_eager"):
        yield


DDP_MIN_BUCKET_MB = 25  # DDP's default bucket size


def ddp_bucket_mb(model: nn.Module) -> int:
    """One transformer block's fp32 gradients per DDP bucket (at least DDP's default 25 MB): each
    block's all-reduce starts as soon as its backward is done and overlaps the next block's; 400m:
    ~48 MB, 1b: ~176 MB (fewer, larger all-reduces than 25 MB buckets)."""
    layers = getattr(model, "layers", None) or [model]
    block = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    return max(DDP_MIN_BUCKET_MB, math.ceil(block / 2**20))


def wrap(model: nn.Module, d: Dist, *, fsdp: bool, device: torch.device, param_dtype: torch.dtype | None = None,
         reshard_after_forward: bool = True) -> nn.Module:
    """DDP (default) or FSDP2 (`fully_shard` per block, then the root) under torchrun.

    FSDP2 shards the parameters in place: the returned object *is* `model`, whose parameters are
    now DTensors (`p.full_tensor()` gathers one; a collective). DDP returns a wrapper whose
    `.module` is `model`, with ordinary parameters.

    `param_dtype` (bf16 when the run computes in bf16): FSDP2 all-gathers and computes with
    parameters in that dtype, halving the all-gather traffic, and reduce-scatters gradients in fp32
    (summing bf16 gradients over many ranks loses bits); the sharded master weights and the
    optimizer stay fp32. `reshard_after_forward`: see the comment below.
    """
    if not d.enabled:
        return model
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Blocks return their (k, v) for the KV cache next to the hidden state; training never
        # touches them in place, so FSDP2's warning about returning views does not apply.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        mesh = device_mesh(d, device.type)
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
        kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        last = len(model.layers) - 1
        for i, layer in enumerate(model.layers):
            # True (ZeRO-3): a block's gathered parameters are freed after its forward and gathered
            # again for its backward: least memory, one more all-gather per block per micro-batch
            # (with --grad-accum N, N of them; they overlap with compute, and under HSDP they stay
            # inside a node). False keeps them until the backward (ZeRO-2 memory, for a model that
            # fits). The last block is never resharded: its backward starts right after the forward,
            # so freeing its parameters would only gather them again at once (torchtitan does the same).
            fully_shard(layer, reshard_after_forward=reshard_after_forward and i < last, **kw)
        # the root (embeddings, tied to the head, and the final norm): FSDP2 keeps a root's parameters
        # gathered after the forward anyway, the head's backward needs them first
        fully_shard(model, reshard_after_forward=False, **kw)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # gradients as views into the all-reduce buckets: no second copy of the gradients (4 B/param)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               bucket_cap_mb=ddp_bucket_mb(model), gradient_as_bucket_view=True)


def reshard(model: nn.Module) -> None:
    """FSDP2: free the parameters a forward left gathered (the root, and a block with
    reshard_after_forward=False, keep them until their backward), so that `parameters()` are this
    rank's shards again; a no-op for any other model."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


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
                    optim_sd: dict | None, *, from_rank0: bool = False) -> None:
    """Load full (unsharded) weights and optimizer state; FSDP2 keeps its shard of each.

    `from_rank0` (under torchrun): only rank 0 passes the state (the others pass {} and None/{}); it
    is broadcast one tensor at a time, so no other rank ever holds the full state in host memory.
    `weights` may lack the tied output head (the checkpoint stores it once, as tok_embeddings)."""
    bcast = from_rank0 and dist.is_available() and dist.is_initialized()
    opts = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=bcast)
    set_model_state_dict(model, weights, options=opts)
    if optimizer is not None and (optim_sd or bcast):
        set_optimizer_state_dict(model, optimizer, optim_sd or {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast))

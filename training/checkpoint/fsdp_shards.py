"""This rank's share of a sharded FSDP2 checkpoint: which rows of each tensor it writes, computed from
the DTensor layout (no collective), and its local rows of every weight and optimizer moment. The
files and their index are training.checkpoint.checkpoint_format's; reading them back is training.checkpoint.checkpoint_io's."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

# (rank, first row, end row): the rows of a tensor's dim 0 one rank writes into a sharded checkpoint
RowSlice = tuple[int, int, int]


def chunk_rows(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [lo, hi) split as torch.chunk splits them (ceil((hi - lo) / parts) each, the last ones
    shorter or empty): part `index`'s rows."""
    chunk = math.ceil((hi - lo) / parts)
    start = min(lo + index * chunk, hi)
    return start, min(start + chunk, hi)


def row_slices(t: torch.Tensor) -> list[RowSlice] | None:
    """Which rank holds which rows of `t`, computed from its DTensor layout (no collective); None for a
    plain tensor (rank 0 writes it whole). FSDP2 shards dim 0 with torch.chunk's split (ceil(rows / n)
    per rank, so the last ranks may hold fewer rows or none); under HSDP each shard is also replicated
    across nodes, and only the replica at coordinate 0 of the replicate dims is listed (it writes)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return None
    ranks = t.device_mesh.mesh
    rows = t.shape[0] if t.dim() else 0
    out = []
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        lo, hi, writes = 0, rows, True
        for mesh_dim, placement in enumerate(t.placements):
            if isinstance(placement, Shard):
                if placement.dim != 0:
                    raise ValueError(f"sharded checkpoints split dim 0 only; a tensor is sharded on dim {placement.dim}")
                lo, hi = chunk_rows(lo, hi, ranks.shape[mesh_dim], coord[mesh_dim])
            elif isinstance(placement, Replicate):
                writes = writes and coord[mesh_dim] == 0
            else:
                raise ValueError(f"sharded checkpoints cannot store a tensor placed as {placement}")
        if writes:
            out.append((int(ranks[coord]), lo, hi))
    return out


@dataclass
class ShardedState:
    """This rank's share of a sharded checkpoint (see training.checkpoint.checkpoint_format): its local rows of
    each weight and optimizer moment, and for every tensor its global shape, dtype and row slices."""

    weights: dict[str, torch.Tensor]  # this rank's local rows (or whole plain tensors, on rank 0)
    optim: dict[str, torch.Tensor]  # "<param name>/<moment>" -> local rows, likewise
    layout: dict[str, dict[str, tuple[list[int], torch.dtype, list[RowSlice] | None]]]  # "model"/"optim" -> ...
    param_groups: list[dict]  # the optimizer's groups, parameters by name (as flatten_optimizer keys them)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, drop: set[str]) -> ShardedState:
    """This rank's local shards of the weights (the names in `drop`, the tied head, left out) and of
    the optimizer state, without any collective: FSDP2's DTensors' local tensors, as they are."""
    def own(t: torch.Tensor, slices: list[RowSlice] | None) -> torch.Tensor | None:
        if slices is None:
            return t.detach() if rank == 0 else None
        mine = [s for s in slices if s[0] == rank]
        if not mine:
            return None  # another node's replica writes these rows (HSDP)
        local = t.to_local().detach()
        want = mine[0][2] - mine[0][1]
        if local.shape[0] != want:  # the layout computed above must be the one FSDP2 made
            raise ValueError(f"rank {rank} holds {local.shape[0]} rows of a tensor, its layout says {want}")
        return local

    st = ShardedState({}, {}, {"model": {}, "optim": {}}, [])
    for name, t in model.state_dict().items():
        if name in drop:
            continue
        slices = row_slices(t)
        st.layout["model"][name] = (list(t.shape), t.dtype, slices)
        if (local := own(t, slices)) is not None:
            st.weights[name] = local
    names = {p: n for n, p in model.named_parameters()}
    for p, moments in optimizer.state.items():
        for moment, v in moments.items():
            v = v if torch.is_tensor(v) else torch.tensor(v)
            key = f"{names[p]}/{moment}"
            slices = row_slices(v)
            st.layout["optim"][key] = (list(v.shape), v.dtype, slices)
            if (local := own(v, slices)) is not None:
                st.optim[key] = local
    for g in optimizer.param_groups:
        st.param_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                "params": [names[p] for p in g["params"]]})
    return st

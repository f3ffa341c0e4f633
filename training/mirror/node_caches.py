"""A URL --out on several nodes (torchrun's LOCAL_WORLD_SIZE < WORLD_SIZE): every node's cache resumes
from the checkpoint rank 0 resumes from.

Each node trains in its own cache (its own disk); rank 0 alone writes one and uploads (training.mirror.run_mirror).
`share(mirror, ...)` runs on every rank after Mirror.prepare (rank 0's check and pull), before the run
folder is read (Checkpointer.pull_remote):

1. Rank 0's resume checkpoint (its cache's newest) must be committed in the store, the one path between
   the nodes' disks. When the store lacks it (node 0 trained past the store's newest while the store
   was down), rank 0 uploads and commits it now, synchronously, with the mirror's own upload code. A
   store that cannot take it stops every rank with the same one line: no node ever resumes from
   another step than node 0.
2. Every other node's local rank 0 pulls exactly that step from the store into its cache (kept when
   the cache holds it already: the marker's sizes and state.json's sha256), and writes rank 0's run
   files that ranks other than 0 read (NODE_FILES, broadcast); processes on one machine take turns on
   a lock file beside the cache, and a node whose cache is rank 0's own folder (same host, same
   path) pulls nothing. A cache holding a newer checkpoint than rank 0's is refused (that step is in
   no store). The other ranks wait in the same collective.

The run folder check that follows (distributed.agree_on_view) then sees the same checkpoint on every
rank. Nodes other than node 0 only read the store.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from training.checkpoint import checkpoint_io as ckpt
from training.loop.rank_agreement import TrainError, agreed
from training.mirror.run_mirror import Mirror, Refused, step_name
from training.model.decoder import ModelConfig
from training.runfiles import layout
from training.store import remote_data
from training.store import remote_run as remote

# the run files ranks other than 0 read (RunFolder.check, EarlyStopping.check_prior): rank 0's, on every node
NODE_FILES = (layout.RUN_MARKER, layout.RUN_CONFIG, layout.EARLY_STOP)


def across_nodes(m: Mirror) -> bool:
    d = m.dist
    return d.enabled and (d.local_world_size or d.world_size) < d.world_size


def share(m: Mirror, model_cfg: ModelConfig, device: torch.device) -> None:
    """Every rank (see the module doc); a no-op on one node. TrainError on every rank when the nodes
    cannot all resume from rank 0's checkpoint."""
    if not across_nodes(m):
        return
    d = m.dist
    plan = agreed(d, device, f"committing node 0's checkpoint to {m.url}",
                  lambda: plan_resume(m, model_cfg) if d.is_main else None)
    box = [plan]
    dist.broadcast_object_list(box, src=0, device=device)
    plan = box[0]
    if plan["missing"]:
        raise TrainError(f"--out {m.url}: node 0's newest checkpoint, step {plan['step']} (in its cache "
                         f"{plan['where'][1]}), is not in the store ({plan['missing']}), so the other nodes "
                         "cannot get it; run the same command again once the store answers (node 0 uploads "
                         "it first), or train on one node")
    agreed(d, device, f"pulling {m.url} into each node's cache",
           lambda: pull_node(m, plan) if d.local_rank == 0 and not d.is_main else None)


def plan_resume(m: Mirror, model_cfg: ModelConfig) -> dict:
    """Rank 0: the step it resumes from (-1: none), committed in the store now if it is not there yet
    (`missing` says why it could not be), where its cache is, and its NODE_FILES."""
    old = layout.read_run_config(m.cache)
    over = old is not None and old.get("model") != model_cfg.to_dict()  # a start over (or a refusal)
    latest = None if over else ckpt.latest(m.cache)
    step = ckpt.step_of(latest) if latest is not None else -1
    plan = {"step": step, "over": over, "missing": "", "where": where(m.cache),
            "files": {n: (m.cache / n).read_bytes() if (m.cache / n).is_file() else None for n in NODE_FILES}}
    if latest is None:
        return plan
    if not m.reached:
        plan["missing"] = "it was unreachable at start"
        return plan
    rel = f"{layout.CHECKPOINTS}/{step_name(step)}"
    try:
        marker = m.remote.read_commit(rel, rel + remote.COMMIT_SUFFIX)
        if marker is not None and same(latest, marker):
            return plan
        m.say(f"committing node 0's checkpoint step {step} to {m.url} before the other nodes pull it")
        if not m.upload_checkpoint(step, prune=False):
            plan["missing"] = f"{latest} could not be staged for the upload"
    except (remote.RemoteError, Refused) as e:
        raise TrainError(str(e)) from None
    except Exception as e:  # the store went down, or refused the write: the other nodes cannot have it
        plan["missing"] = f"uploading it failed: {e}"
    return plan


def pull_node(m: Mirror, plan: dict) -> None:
    """A node's local rank 0 (node 0 aside): rank 0's NODE_FILES and its resume checkpoint, from the store,
    into this node's cache, one process at a time per machine; TrainError when this cache would resume
    from another checkpoint than rank 0."""
    if where(m.cache) == tuple(plan["where"]):
        return  # rank 0's own folder (same host, same path): nothing to pull
    with remote_data.locked(m.cache):
        for name, data in plan["files"].items():
            path = m.cache / name
            if data is None:
                path.unlink(missing_ok=True)
                continue
            m.cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".tmp-node-{name}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        step = plan["step"]
        if step >= 0:
            _pull_step(m, step)
        if plan["over"]:
            return  # a start over: the checkpoints here are not read
        latest = ckpt.latest(m.cache)
        have = ckpt.step_of(latest) if latest is not None else -1
        if have != step:
            wants = f"step {step}" if step >= 0 else "no checkpoint (a fresh start)"
            raise TrainError(f"--cache {m.cache} (rank {m.dist.rank}'s node) holds checkpoint step {have}, but "
                             f"rank 0 resumes from {wants}: that checkpoint is in no store; start this machine "
                             "as node 0 (it is uploaded first), or move it out of the cache")


def _pull_step(m: Mirror, step: int) -> None:
    rel = f"{layout.CHECKPOINTS}/{step_name(step)}"
    dest = m.cache / rel
    try:
        r = remote.Remote(m.url)
        marker = r.read_commit(rel, rel + remote.COMMIT_SUFFIX)
        if marker is None:
            raise TrainError(f"--out {m.url} holds no committed checkpoint of step {step}, which rank 0 resumes from")
        if same(dest, marker):
            return
        if not r.download_checkpoint(step, marker, dest):
            raise TrainError(f"--out {m.url}/{rel}: a file differs from its commit marker's sha256; run the same "
                             "command again")
    except remote.Unreachable as e:
        raise TrainError(f"--out {m.url}: rank {m.dist.rank}'s node cannot reach the store ({e}) to pull "
                         f"checkpoint step {step}, which rank 0 resumes from") from None
    except remote.RemoteError as e:
        raise TrainError(str(e)) from None


def where(cache: Path) -> tuple[str, str]:
    """This machine and the cache's real path: two ranks with the same one share the folder."""
    return socket.gethostname(), str(cache.expanduser().resolve())


def same(folder: Path, marker: dict) -> bool:
    """The checkpoint folder holds the committed one: the marker's files at its sizes, and its state.json
    (what every rank's resume decision compares, distributed.RunView) with the marker's sha256."""
    files = marker.get("files") or {}
    if not folder.is_dir() or {f.name: f.stat().st_size for f in folder.iterdir() if f.is_file()} != \
            {k: v.get("size") for k, v in files.items()}:
        return False
    want = (files.get(ckpt.STATE_FILE) or {}).get("sha256")
    return hashlib.sha256((folder / ckpt.STATE_FILE).read_bytes()).hexdigest() == want

"""The checkpoint folder format, shared by the writing half (training.checkpoint.checkpoint_write) and the reading
half (training.checkpoint.checkpoint_io): file names, the state.json schema, how optimizer moments and RNG states are
keyed in optim.safetensors, and finding, resolving and removing step_* folders. Callers import these
through training.checkpoint.checkpoint_io, the one public face of the format."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from training.runfiles import layout

FORMAT_VERSION = 1
# the file names are layout's; these aliases are what training.checkpoint.checkpoint_io has long exported
MODEL_FILE, OPTIM_FILE, STATE_FILE, CONFIG_FILE, TOKENIZER_FILE = (
    layout.MODEL_WEIGHTS, layout.OPTIMIZER, layout.STATE, layout.MODEL_CONFIG, layout.TOKENIZER)
STEP_PREFIX = layout.STEP_PREFIX
TMP_PREFIX = ".tmp-"
RNG_PREFIX = "rng/"
CPU_RNG = "torch_cpu"  # the RNG state every checkpoint holds (training.optim.rng_state)
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq", "step")  # what AdamW keeps per parameter

# A sharded checkpoint (FSDP2: each rank writes its own rows, nothing is gathered) holds, instead of
# model.safetensors and optim.safetensors, one pair of shard files per writing rank and an index:
#   model.rank00001-of-00002.safetensors   that rank's rows of each weight (dim 0, torch.chunk's split)
#   optim.rank00001-of-00002.safetensors   its rows of each optimizer moment (rank 0's also: RNG, `step`s)
#   shards.json                            per tensor: global shape, dtype, and which rows each file holds
SHARD_INDEX_FILE = "shards.json"
SHARD_KINDS = ("model", "optim")  # the index's two sections, and the shard files' name stems
SHARD_FORMAT = 1  # shards.json's own "prodip_shards" version


# shards.json's "digests" (written since this key exists; an index without it is still read, with a
# warning: training.checkpoint.checkpoint_verify): {file name: {"size": bytes, "sha256": hex}} per file of "files",
# each rank hashing its own files as it writes them (record_digests), rank 0 gathering them into the
# index at the commit (gather_digests); every reader checks them before it uses a file
SHARD_DIGESTS = "digests"
DIGEST_CHUNK = 1 << 22  # bytes hashed per read: 4 MiB


def file_digest(path: Path) -> dict[str, int | str]:
    """{"size": bytes, "sha256": hex} of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(DIGEST_CHUNK):
            h.update(chunk)
    return {"size": Path(path).stat().st_size, "sha256": h.hexdigest()}


def _digests_file(rank: int, world_size: int) -> str:
    return f"{TMP_PREFIX}digests.rank{rank:05d}-of-{world_size:05d}.json"


def record_digests(tmp: Path, rank: int, world_size: int) -> None:
    """A writing rank's own shard files hashed by that rank, just written (from the page cache), every rank
    at once: rank 0 alone would hash the whole checkpoint on the save's critical path (a preemption's
    grace). Left in the temporary folder for gather_digests."""
    names = [shard_file(kind, rank, world_size) for kind in SHARD_KINDS]
    text = json.dumps({name: file_digest(Path(tmp) / name) for name in names})
    (Path(tmp) / _digests_file(rank, world_size)).write_text(text, encoding="utf-8")


def gather_digests(tmp: Path, files: list[str]) -> dict[str, dict[str, int | str]]:
    """shards.json's "digests" for `files`: what each rank recorded (its record then removed: not part of
    the checkpoint), a file no record covers hashed here."""
    digests: dict = {}
    for rec in sorted(Path(tmp).glob(f"{TMP_PREFIX}digests.rank*.json")):
        digests.update(json.loads(rec.read_text(encoding="utf-8")))
        rec.unlink()
    return {name: digests.get(name) or file_digest(Path(tmp) / name) for name in files}


def shard_file(kind: str, rank: int, world_size: int) -> str:
    """The name of `rank`'s shard file of `kind` ("model" or "optim") in a run of `world_size` ranks."""
    return f"{kind}.rank{rank:05d}-of-{world_size:05d}.safetensors"


def is_sharded(c: Path) -> bool:
    """A checkpoint folder written by every rank (shards.json) rather than by rank 0 alone."""
    return (Path(c) / SHARD_INDEX_FILE).is_file()


def has_weights(c: Path) -> bool:
    """The folder holds model weights in either form (model.safetensors, or shards and their index)."""
    return (Path(c) / MODEL_FILE).is_file() or is_sharded(c)


class CheckpointError(ValueError):
    pass


# what every state.json holds (checkpoint.save writes these); a resume needs the RESUME_ keys too
STATE_SCHEMA: layout.Schema = {"step": int, "tokenizer_sha256": str}
RESUME_STATE_SCHEMA: layout.Schema = {**STATE_SCHEMA, "tokens": int, "data": dict}


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def flatten_optimizer(optim_sd: dict, names: list[str]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """torch optimizer state_dict -> ({"name/moment": tensor}, JSON param groups with names).

    Accepts both index-keyed (plain `optimizer.state_dict()`, with `names` in parameter order) and
    name-keyed state (torch.distributed.checkpoint's full optimizer state dict)."""
    tensors = {}
    for key, st in optim_sd["state"].items():
        name = names[key] if isinstance(key, int) else key
        for moment, v in st.items():  # left on their device: the writer copies them (or write() does)
            tensors[f"{name}/{moment}"] = v.detach() if torch.is_tensor(v) else torch.tensor(v)
    groups = []
    for g in optim_sd["param_groups"]:
        g2 = {k: v for k, v in g.items() if k != "params"}
        g2["params"] = [names[p] if isinstance(p, int) else p for p in g["params"]]
        groups.append(g2)
    return tensors, groups


def unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict], names: list[str] | None) -> dict:
    """Inverse of flatten_optimizer; index-keyed when `names` (parameter order) is given."""
    index = {n: i for i, n in enumerate(names)} if names is not None else None
    state: dict = {}
    for k, v in tensors.items():
        name, moment = k.rsplit("/", 1)
        key = index[name] if index is not None else name
        state.setdefault(key, {})[moment] = v
    pgs = []
    for g in groups:
        g2 = dict(g)
        g2["params"] = [index[p] for p in g["params"]] if index is not None else list(g["params"])
        pgs.append(g2)
    return {"state": state, "param_groups": pgs}


def step_of(path: Path) -> int | None:
    """N of a folder named step_N (None for any other name)."""
    digits = path.name[len(STEP_PREFIX):]
    return int(digits) if path.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Every step_* folder, oldest first. Temporary folders are never listed; a step_* folder is
    complete by construction (renamed into place whole), so one that has lost a file since is listed
    too, and reading it fails naming the file, rather than a resume silently falling back to an older one."""
    root = Path(run_dir) / layout.CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def remove(path: Path) -> None:
    """Delete a checkpoint: renamed to a temporary name first (atomic), so a kill mid-delete never
    leaves a half-deleted step_* folder for `latest()` to find; a later save clears the rest."""
    doomed = path.with_name(f"{TMP_PREFIX}del-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def latest(run_dir: Path) -> Path | None:
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


def resolve(path: str | os.PathLike, step: int | None = None) -> Path:
    """A checkpoint folder from a RUN_DIR (latest, or `step`) or a checkpoint folder itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"not found: {p}")
    if has_weights(p) and (p / CONFIG_FILE).is_file():
        return p
    if step is not None:
        c = p / layout.CHECKPOINTS / step_dir_name(step)
        if not c.is_dir():
            raise CheckpointError(f"no checkpoint for step {step} in {p}")
        return c
    c = latest(p)
    if c is None:
        raise CheckpointError(f"{p} holds no complete checkpoint (expected a run folder or a checkpoint folder)")
    return c


"""What a checkpoint must hold when it is read, whoever reads it (a resume, --init, an export, an
evaluation, the server): training.checkpoint.checkpoint_io's readers call these, so every stage gets the same checks.

- state.json: its step is the step in the folder's name (step_0000123) and >= 0; every counter
  (tokens, elapsed seconds, the data position, the early-stop record) of its type and in range; no
  NaN or Infinity anywhere (Python's json reads both, though they are not JSON).
- config.json: through the model schema strictly (every field present, `"vocab_size": "2000"` is a
  string, not a number): the file is ours, written from a checked ModelConfig, so any coercion would
  only hide damage.
- tensors: no NaN or inf in the weights or optimizer moments as read.
- a sharded checkpoint's files: the size and sha256 shards.json recorded for each when it was written
  (so two rank files of equal shape swapped are refused by name, not assembled into a wrong model).
- the weights and optimizer moments against the model (check_fits, check_optimizer_fits): names,
  shapes, floating-point dtypes, the RNG state.

Each failure is one CheckpointError naming the file and the field.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field

from training.checkpoint.checkpoint_format import (
    ADAM_MOMENTS,
    CPU_RNG,
    RNG_PREFIX,
    SHARD_DIGESTS,
    CheckpointError,
    file_digest,
    step_of,
)
from training.checkpoint.checkpoint_write import nonfinite
from training.model.decoder import ModelConfig, field_types
from training.runfiles.schema import SchemaError, check, reject_unknown

# every counter is an int64 somewhere (torch, numpy): [0, 2^63)
Count = Annotated[int, Field(ge=0, lt=2**63)]
Positive = Annotated[int, Field(gt=0, lt=2**63)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Loss = Annotated[float, Field(allow_inf_nan=False)] | None

# state.json's counters, where present (which are required is the caller's schema: checkpoint_format)
STATE_VALUES: dict[str, Any] = {"step": Count, "tokens": Count, "elapsed_s": Seconds, "world_size": Positive}
# its data position (training.data.loaders's loaders' state_dict) and early-stop record (loop.early_stopping)
DATA_VALUES: dict[str, Any] = {"consumed": Count, "seq_len": Positive, "n_windows": Positive, "n_rows": Positive,
                               "epoch": Count, "index": Count}
EARLY_STOP_VALUES: dict[str, Any] = {"step": Count, "evals_since": Count, "val_loss": Loss}


def _values(obj: dict, types: dict[str, Any], where: str, prefix: str = "") -> None:
    for key, type_ in types.items():
        if key in obj:
            try:
                check(type_, obj[key], f"{where}: {prefix}{key}", strict=True)
            except SchemaError as e:
                raise CheckpointError(str(e)) from None


def first_nonfinite(obj: object) -> str | None:
    """The path ("a.b[2]") of the first NaN or +-Infinity in a parsed JSON value, or None. Iterative:
    the depth is whatever json.loads accepted."""
    stack: list[tuple[str, object]] = [("", obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return path or "(the value)"
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


def check_state(state: dict, c: Path, file: Path) -> dict:
    """state.json's values (see the module doc); `c` the checkpoint folder whose name holds its step."""
    where = str(file)
    bad = first_nonfinite(state)
    if bad is not None:
        raise CheckpointError(f"{where}: {bad} is not a finite number (a damaged checkpoint)")
    _values(state, STATE_VALUES, where)
    named = step_of(c)
    if named is not None and state.get("step") != named:
        raise CheckpointError(f"{where}: step = {state.get('step')!r} is not the step in its folder's name "
                              f"{c.name}; a damaged or renamed checkpoint: delete that folder to resume from "
                              "the one before")
    for key, types in (("data", DATA_VALUES), ("early_stop", EARLY_STOP_VALUES)):
        if isinstance(state.get(key), dict):
            _values(state[key], types, where, f"{key}.")
    best = state.get("early_stop")
    if isinstance(best, dict) and isinstance(state.get("step"), int) and (best.get("step") or 0) > state["step"]:
        raise CheckpointError(f"{where}: early_stop.step = {best['step']} is after the checkpoint's step "
                              f"{state['step']}")
    return state


def strict_model_config(d: dict, file: Path) -> ModelConfig:
    """config.json (already read as a JSON object) as a ModelConfig: every field present, of its exact type
    and in range; CheckpointError naming the file and the field otherwise."""
    types = field_types(ModelConfig)
    try:
        reject_unknown("model config key", d, types, str(file))
        missing = [k for k in types if k not in d]
        if missing:
            raise SchemaError(f"{file}: model config lacks {missing[0]!r} (damaged, or not a prodip checkpoint?)")
        for k, v in d.items():
            check(types[k], v, f"{file}: {k}", strict=True)
        return ModelConfig.from_dict(d)  # the fields' relations (d_model / n_heads, ...) too
    except (SchemaError, TypeError, ValueError) as e:
        msg = str(e)
        raise CheckpointError(msg if str(file) in msg else f"{file}: not a valid model config ({msg})") from None


def check_tensors_finite(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """No NaN or inf in the floating-point tensors read from `file` (checked on their device, one sum each)."""
    bad = nonfinite(tensors)
    if bad:
        raise CheckpointError(f"{file}: {bad[0]} holds non-finite values (NaN or inf); the checkpoint is damaged "
                              "(delete that folder to resume from the one before)")


def check_fits(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Every weight of `model` in `weights` with its shape and a floating-point dtype (the tied head may be
    absent), before loading."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        expected.pop("output.weight", None)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected) - {"output.weight"})
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{where}: weights do not fit the model: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}, wrong shape {wrong[:3]}")
    # a header that says I32 over a float payload of the same size reads without an error: only the dtype tells
    not_float = sorted(k for k, v in weights.items() if not v.dtype.is_floating_point)
    if not_float:
        raise CheckpointError(f"{where}: weights are not floating point: {not_float[0]} is {weights[not_float[0]].dtype}")


def check_optimizer_fits(params: list[tuple[str, torch.nn.Parameter]], tensors: dict[str, torch.Tensor],
                         rng: dict[str, torch.Tensor], where: Path) -> None:
    """AdamW moments (exp_avg, exp_avg_sq of each parameter's shape, and step) for every trainable
    parameter that has any, and a CPU RNG state torch accepts: anything less would resume, but not exactly."""
    for name, p in params:
        present = [m for m in ADAM_MOMENTS if f"{name}/{m}" in tensors]
        if not present:
            continue  # AdamW makes a parameter's state at its first update: none yet is exact too
        for moment in ADAM_MOMENTS:
            t = tensors.get(f"{name}/{moment}")
            if t is None:
                raise CheckpointError(f"{where}: no optimizer state {name}/{moment}")
            if not t.dtype.is_floating_point:  # AdamW keeps its moments and its step count as floats
                raise CheckpointError(f"{where}: optimizer state {name}/{moment} is {t.dtype}, not floating point")
            if moment != "step" and tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{where}: optimizer state {name}/{moment} has shape {tuple(t.shape)}, "
                                      f"the parameter {tuple(p.shape)}")
    cpu = rng.get(CPU_RNG)
    if cpu is None or cpu.dtype != torch.uint8 or cpu.numel() != torch.get_rng_state().numel():
        raise CheckpointError(f"{where}: damaged RNG state {RNG_PREFIX}{CPU_RNG}")


# ------------------------------------------------------------------------------------ shard files
DIGEST_SCHEMA: dict[str, Any] = {"size": Count, "sha256": Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]}
_warned: set[str] = set()  # index files already warned about (once per process, not per reader)


def recorded_digests(index: dict, index_file: Path) -> dict[str, dict[str, Any]] | None:
    """The digests shards.json records per file, checked, or None for an index written before they were
    (accepted, with a warning once: docs/reliability.md, "Checkpoints and run folders, checked", says why)."""
    digests = index.get(SHARD_DIGESTS)
    if digests is None:
        if str(index_file) not in _warned:
            _warned.add(str(index_file))
            print(f"warning: {index_file} records no size or sha256 per shard file (written by an older prodip); "
                  "its files are checked by shape only", file=sys.stderr)
        return None
    files = index["files"]
    if not all(isinstance(f, str) for f in files):  # a name that is not a string: _path() names it later
        return None
    if not isinstance(digests, dict) or set(digests) != set(files):
        raise CheckpointError(f"{index_file}: 'digests' must name each file of 'files' once")
    for name, d in digests.items():
        if not isinstance(d, dict) or set(d) != set(DIGEST_SCHEMA):
            raise CheckpointError(f"{index_file}: digests.{name} must be {{\"size\", \"sha256\"}}")
        _values(d, DIGEST_SCHEMA, str(index_file), f"digests.{name}.")
    return digests


def check_size(f: Path, recorded: dict[str, Any], index_file: Path) -> None:
    size = f.stat().st_size
    if size != recorded["size"]:
        raise CheckpointError(f"{f}: {size} bytes, {index_file} recorded {recorded['size']} when it was written "
                              "(truncated, or replaced since)")


def check_digest(f: Path, recorded: dict[str, Any], index_file: Path) -> None:
    if file_digest(f)["sha256"] != recorded["sha256"]:
        raise CheckpointError(f"{f}: its sha256 is not the one {index_file} recorded when it was written "
                              "(another rank's file, or changed since); the checkpoint is damaged")

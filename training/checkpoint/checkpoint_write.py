"""Writing checkpoints (the format: training.checkpoint.checkpoint_format; callers use training.checkpoint.checkpoint_io).

A checkpoint is written into a hidden temporary folder, fsynced, and renamed into place: a folder
named step_* is complete by construction, and `latest()` never sees a partial save. Non-finite
weights are refused before anything is written.

Training saves through a CheckpointWriter: the tensors are finite-checked where they live (one small
host read), copied into reusable host buffers (pinned, with non-blocking copies, from a GPU), and
written by a background thread while training goes on. At most one write is in flight: the next save
waits for it first, and a write that failed raises its error there (or at `wait()`, before the run
ends). `asynchronous=False` writes in the caller's thread instead (--no-async-checkpoints, debugging).

Under FSDP2 every rank writes its own shards instead (begin_sharded, write_shard, commit_sharded:
see "sharded saves" below), synchronously, into one temporary folder that rank 0 renames into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Container
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError

from training.checkpoint.checkpoint_format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MODEL_FILE,
    OPTIM_FILE,
    RNG_PREFIX,
    SHARD_DIGESTS,
    SHARD_FORMAT,
    SHARD_INDEX_FILE,
    SHARD_KINDS,
    STATE_FILE,
    TMP_PREFIX,
    TOKENIZER_FILE,
    CheckpointError,
    gather_digests,
    list_checkpoints,
    record_digests,
    remove,
    shard_file,
    step_dir_name,
    step_of,
)
from training.model.decoder import ModelConfig
from training.runfiles import layout
from training.runfiles.file_ops import removed_on_failure, save_safetensors
from training.text.tokenizer import Tokenizer

WEIGHTS_METADATA = {"format": "pt", "prodip_format": str(FORMAT_VERSION)}  # a weights file's safetensors header


def drop_tied(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights a checkpoint stores: the tied head dropped (safetensors stores no shared tensors)."""
    return {k: v for k, v in state_dict.items() if not (cfg.tie_embeddings and k == "output.weight")}


def weights_for_save(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Contiguous CPU fp32 tensors, the tied head dropped (CPU fp32 ones are not copied)."""
    return _fp32_host(drop_tied(state_dict, cfg))


def _fp32_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The floating-point tensors holding a NaN or inf, decided on their own device: one small host
    read per device, never a host-side scan of the state.

    A tensor's sum is finite only if every element is (IEEE: inf + -inf is NaN, NaN propagates), so one
    summing pass per tensor clears it; only a tensor whose sum is not finite (a NaN or inf, or finite
    values that overflowed the sum) is checked element by element. `isfinite(t).all()` on everything
    wrote a bool copy of the whole state and ran at ~30 M elements/s on the CPU (75 s for a 400m
    checkpoint's weights and moments under load; 7.7 s with the sums: tests/benchmarks/bench_preempt.py)."""
    by_device: dict[torch.device, list[str]] = {}
    for k, v in tensors.items():
        if v.is_floating_point() and v.numel():
            by_device.setdefault(v.device, []).append(k)
    bad = []
    for names in by_device.values():
        sums = torch.stack([tensors[k].detach().sum().float() for k in names])
        for k, ok in zip(names, torch.isfinite(sums).tolist(), strict=True):
            if not ok and not bool(torch.isfinite(tensors[k]).all()):  # an overflowed sum is not a NaN
                bad.append(k)
    return bad


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    bad = nonfinite(tensors)
    if bad:
        raise CheckpointError(f"refusing to save {what}: {bad[0]} holds non-finite values")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())


def save(run_dir: Path, step: int, *, weights: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Tokenizer,
         optim_tensors: dict[str, torch.Tensor] | None = None, rng: dict[str, torch.Tensor] | None = None,
         state: dict | None = None, keep_last: int = 0, keep: Container[int] = ()) -> Path:
    """Atomically write checkpoint `step`; then prune to the newest `keep_last` (0 keeps all), never
    pruning the steps in `keep` (early stopping's best one). Non-finite tensors are refused first."""
    check_finite(weights, "weights")
    if optim_tensors:
        check_finite(optim_tensors, "optimizer state")
    return write(run_dir, step, weights=weights, cfg=cfg, tokenizer=tokenizer, optim_tensors=optim_tensors, rng=rng,
                 state=state, keep_last=keep_last, keep=keep)


def _host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}  # no copy for CPU tensors


def _optim_file_tensors(optim_tensors: dict[str, torch.Tensor] | None,
                        rng: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """What an optimizer file holds: the moments (and step counts) and the RNG states under RNG_PREFIX."""
    out = _host(optim_tensors or {})
    out.update(_host({RNG_PREFIX + k: v for k, v in (rng or {}).items()}))
    return out


def write(run_dir: Path, step: int, *, weights: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Tokenizer,
          optim_tensors: dict[str, torch.Tensor] | None = None, rng: dict[str, torch.Tensor] | None = None,
          state: dict | None = None, keep_last: int = 0, keep: Container[int] = ()) -> Path:
    """save() without the finite check (the caller has made it): the atomic write and the pruning."""
    ckpt_root = Path(run_dir) / layout.CHECKPOINTS
    tmp = ckpt_root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}"
    with _writing(ckpt_root, step, tmp):
        _fresh_tmp(ckpt_root, tmp)
        save_safetensors(_host(weights), tmp / MODEL_FILE,  # the user's umask, not safetensors' 0600
                         metadata=WEIGHTS_METADATA)
        extra = _optim_file_tensors(optim_tensors, rng)
        if extra:
            save_safetensors(extra, tmp / OPTIM_FILE)
    return _commit(run_dir, step, tmp, cfg=cfg, tokenizer=tokenizer, state=state, keep_last=keep_last, keep=keep)


def _writing(ckpt_root: Path, step: int, tmp: Path) -> contextlib.AbstractContextManager[None]:
    """A failed write leaves no temporary folder; an OSError (a full disk) is one clear line, and the
    older checkpoints are untouched."""
    return removed_on_failure(tmp, lambda why: CheckpointError(
        f"could not write checkpoint {step} in {ckpt_root} ({why}); the previous checkpoints are intact: "
        "free some space, then run the same command again to resume"))


def _fresh_tmp(ckpt_root: Path, tmp: Path) -> None:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(TMP_PREFIX + "*"):  # left behind by a save that was killed mid-way
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()


def _commit(run_dir: Path, step: int, tmp: Path, *, cfg: ModelConfig, tokenizer: Tokenizer, state: dict | None,
            keep_last: int, keep: Container[int]) -> Path:
    """The JSON files and the tokenizer into `tmp` (its tensor files are there), everything fsynced, `tmp`
    renamed into place as step_N, then keep-N pruning."""
    ckpt_root = Path(run_dir) / layout.CHECKPOINTS
    final = ckpt_root / step_dir_name(step)
    with _writing(ckpt_root, step, tmp):
        _write_json(tmp / STATE_FILE, {"prodip_format": FORMAT_VERSION, "step": step,
                                       "tokenizer_sha256": tokenizer.sha256, **(state or {})})
        _write_json(tmp / CONFIG_FILE, cfg.to_dict())
        tokenizer.save(tmp / TOKENIZER_FILE)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
            old = ckpt_root / f"{TMP_PREFIX}old-{step_dir_name(step)}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_root)
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            if step_of(old) not in keep:
                remove(old)
    return final


# ------------------------------------------------------------------- sharded saves (FSDP2, every rank)
# One save, in three steps with a collective between each (training.loop.checkpointer): rank 0 makes
# the shared temporary folder (begin_sharded); every rank writes its own shard files into it
# (write_shard); rank 0 writes the index, state.json, config.json and the tokenizer and renames the
# folder into place (commit_sharded), so a step_* folder still holds every rank's files or does not exist.
def sharded_tmp(run_dir: Path, step: int) -> Path:
    """The temporary folder every rank writes into (one name for all: the ranks' pids differ)."""
    return Path(run_dir) / layout.CHECKPOINTS / f"{TMP_PREFIX}{step_dir_name(step)}-sharded"


def begin_sharded(run_dir: Path, step: int) -> Path:
    """Rank 0: an empty temporary folder for checkpoint `step` (stale ones from killed saves removed)."""
    tmp = sharded_tmp(run_dir, step)
    with _writing(tmp.parent, step, tmp):
        _fresh_tmp(tmp.parent, tmp)
    return tmp


def write_shard(tmp: Path, step: int, rank: int, world_size: int, *, weights: dict[str, torch.Tensor],
                optim_tensors: dict[str, torch.Tensor], rng: dict[str, torch.Tensor] | None = None) -> None:
    """This rank's two shard files (weights in fp32), fsynced; `rng` only from rank 0. On failure the
    folder is left for rank 0 to remove (the other ranks may still be writing into it)."""
    try:
        save_safetensors(_fp32_host(weights), tmp / shard_file("model", rank, world_size),
                         metadata=WEIGHTS_METADATA)
        save_safetensors(_optim_file_tensors(optim_tensors, rng), tmp / shard_file("optim", rank, world_size))
        for kind in SHARD_KINDS:
            with open(tmp / shard_file(kind, rank, world_size), "rb") as fh:
                os.fsync(fh.fileno())
        record_digests(tmp, rank, world_size)  # this rank's files' size and sha256, for shards.json
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"could not write rank {rank}'s shards of checkpoint {step} in {tmp.parent} ({e}); "
                              "the previous checkpoints are intact: free some space, then run the same command "
                              "again to resume") from None


def shard_index(world_size: int, tensors: dict[str, dict[str, tuple[list[int], torch.dtype, list | None]]],
                rng_names: Container[str] = ()) -> dict:
    """shards.json: per section ("model", "optim") and tensor its global shape, dtype and parts: [file,
    first row, end row] per writing rank (rows of dim 0), or one [file, null, null] for a whole tensor in
    rank 0's file. `tensors`: distributed_shards.ShardedState.layout; `rng_names` (RNG states) are rank 0's, whole."""
    index: dict = {"prodip_shards": SHARD_FORMAT, "world_size": world_size, "files": [],
                   **{kind: {} for kind in SHARD_KINDS}}
    writers = {0}
    for kind in SHARD_KINDS:
        for name, (shape, dtype, slices) in tensors.get(kind, {}).items():
            if slices is None:
                parts = [[shard_file(kind, 0, world_size), None, None]]
            else:
                writers.update(r for r, _, _ in slices)
                parts = [[shard_file(kind, r, world_size), lo, hi] for r, lo, hi in slices if hi > lo]
            stored = torch.float32 if kind == "model" and dtype.is_floating_point else dtype  # fp32 weights
            index[kind][name] = {"shape": shape, "dtype": str(stored).removeprefix("torch."), "parts": parts}
    for name in rng_names:
        index["optim"][RNG_PREFIX + name] = {"shape": None, "dtype": "uint8",
                                             "parts": [[shard_file("optim", 0, world_size), None, None]]}
    index["files"] = [shard_file(kind, r, world_size) for r in sorted(writers) for kind in SHARD_KINDS]
    return index


def commit_sharded(run_dir: Path, step: int, tmp: Path, *, index: dict, cfg: ModelConfig, tokenizer: Tokenizer,
                   state: dict | None = None, keep_last: int = 0, keep: Container[int] = ()) -> Path:
    """Rank 0, once every rank's shards are in `tmp`: the index, then as write() (JSON, rename, keep-N)."""
    with _writing(tmp.parent, step, tmp):
        missing = [f for f in index["files"] if not (tmp / f).is_file()]
        if missing:  # every rank reported success: a file gone now is another process's doing
            raise CheckpointError(f"{tmp / missing[0]}: a rank's shard file is missing; checkpoint {step} not saved")
        # each file's size and sha256, so a reader refuses a swapped or changed shard by name
        _write_json(tmp / SHARD_INDEX_FILE, {**index, SHARD_DIGESTS: gather_digests(tmp, index["files"])})
    return _commit(run_dir, step, tmp, cfg=cfg, tokenizer=tokenizer, state=state, keep_last=keep_last, keep=keep)


class CheckpointWriter:
    """Checkpoints written off the training loop (see the module doc). One per run; rank 0's.

    `stall_s` and `write_s` hold, per save, the seconds the caller was blocked (check + copy; the
    whole write when synchronous) and the seconds the write itself took."""

    def __init__(self, *, asynchronous: bool = True):
        self.asynchronous = asynchronous
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # host copies, reused by every save (same shapes)
        self.stall_s: list[float] = []
        self.write_s: list[float] = []

    def save(self, run_dir: Path, step: int, *, weights: dict[str, torch.Tensor], cfg: ModelConfig,
             tokenizer: Tokenizer, optim_tensors: dict[str, torch.Tensor], rng: dict[str, torch.Tensor],
             state: dict, keep_last: int = 0, keep: Container[int] = (), fresh: bool = False,
             checked: bool = False) -> None:
        """Checkpoint `step` of the given tensors (on any device; weights are stored in fp32). Waits for
        the previous write first and raises its CheckpointError; refuses non-finite tensors before any
        copy. Returns once the tensors are copied: the caller may then change them. `fresh`: they are
        CPU copies nobody else holds (FSDP2's gathered state), written without another copy. `checked`:
        the caller has finite-checked them already (the trainer does, on the device, before gathering)."""
        self.wait()
        t0 = time.perf_counter()
        if not checked:
            check_finite(weights, "weights")
            check_finite(optim_tensors, "optimizer state")
        kw = dict(cfg=cfg, tokenizer=tokenizer, state=json.loads(json.dumps(state)), keep_last=keep_last, keep=keep)
        if not self.asynchronous:
            weights = {k: v.to(torch.float32) for k, v in weights.items()}
            self._write(None, run_dir, step, weights=weights, optim_tensors=optim_tensors, rng=rng, **kw)
            self.stall_s.append(time.perf_counter() - t0)
            return
        if fresh and all(v.device.type == "cpu" for v in (*weights.values(), *optim_tensors.values())):
            weights = {k: v.to(torch.float32) for k, v in weights.items()}  # no copy when already fp32
            # FSDP2 gathers DTensors only: the optimizer's 0-dim entries (AdamW's `step`) come back as the
            # live tensors, which the next optimizer step increments in place while this thread writes
            optim_tensors = {k: v.clone() if v.dim() == 0 else v for k, v in optim_tensors.items()}
        else:
            weights = self._stage("model/", weights, torch.float32)
            optim_tensors = self._stage("optim/", optim_tensors)
        rng = {k: v.detach().to("cpu", copy=True) for k, v in rng.items()}
        copied = None
        if any(v.is_cuda for v in (*weights.values(), *optim_tensors.values())):
            copied = torch.cuda.Event()  # the non-blocking copies are queued before it on this stream
            copied.record()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._inflight = self._pool.submit(self._write, copied, run_dir, step, weights=weights,
                                           optim_tensors=optim_tensors, rng=rng, **kw)
        self.stall_s.append(time.perf_counter() - t0)

    def reserve(self, weights: dict[str, torch.Tensor], optim_tensors: dict[str, torch.Tensor]) -> int:
        """Allocate (and touch) the host buffers a save() of tensors shaped like these will copy into, and
        start the writer thread, before any save: a preemption's save, with seconds of grace, then only
        copies. Nothing is copied. Returns the bytes reserved (0 when synchronous: nothing is staged)."""
        if not self.asynchronous:
            return 0
        before = sum(b.nbytes for b in self._buffers.values())
        for prefix, tensors, dtype in (("model/", weights, torch.float32), ("optim/", optim_tensors, None)):
            for k, v in tensors.items():
                self._buffer(prefix + k, v, dtype).zero_()  # zero_: the pages faulted in now, not during a save
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return sum(b.nbytes for b in self._buffers.values()) - before

    def _buffer(self, key: str, v: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """This writer's host buffer for `v` under `key` (pinned for a GPU tensor), reused when it fits."""
        want = dtype if dtype is not None and v.is_floating_point() else v.dtype
        buf = self._buffers.get(key)
        if buf is None or buf.shape != v.shape or buf.dtype != want:
            buf = torch.empty(v.shape, dtype=want, pin_memory=v.is_cuda)
            self._buffers[key] = buf
        return buf

    def _stage(self, prefix: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None
               ) -> dict[str, torch.Tensor]:
        """Host copies of `tensors` in this writer's buffers: pinned and non-blocking from a GPU."""
        out = {}
        for k, v in tensors.items():
            v = v.detach()
            buf = self._buffer(prefix + k, v, dtype)
            buf.copy_(v, non_blocking=v.is_cuda)
            out[k] = buf
        return out

    def _write(self, copied: torch.cuda.Event | None, run_dir: Path, step: int, **kw) -> Path:
        if copied is not None:
            copied.synchronize()
        t0 = time.perf_counter()
        path = write(run_dir, step, **kw)
        self.write_s.append(time.perf_counter() - t0)
        return path

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is on disk; its path, or its error raised here, once."""
        inflight, self._inflight = self._inflight, None
        return inflight.result() if inflight is not None else None

    def close(self) -> None:
        """Wait for the last write (its error is raised) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


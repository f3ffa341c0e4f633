"""Writing checkpoints (the format: training.checkpoint_format; callers use training.checkpoint).

A checkpoint is written into a hidden temporary folder, fsynced, and renamed into place: a folder
named step_* is complete by construction, and `latest()` never sees a partial save. Non-finite
weights are refused before anything is written.

Training saves through a CheckpointWriter: the tensors are finite-checked where they live (one small
host read), copied into reusable host buffers (pinned, with non-blocking copies, from a GPU), and
written by a background thread while training goes on. At most one write is in flight: the next save
waits for it first, and a write that failed raises its error there (or at `wait()`, before the run
ends). `asynchronous=False` writes in the caller's thread instead (--no-async-checkpoints, debugging).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Container
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError

from training import layout
from training.checkpoint_format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MODEL_FILE,
    OPTIM_FILE,
    RNG_PREFIX,
    STATE_FILE,
    TMP_PREFIX,
    TOKENIZER_FILE,
    CheckpointError,
    list_checkpoints,
    remove,
    step_dir_name,
    step_of,
)
from training.files import save_safetensors
from training.model import ModelConfig
from training.tokenizer import Tokenizer


def drop_tied(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights a checkpoint stores: the tied head dropped (safetensors stores no shared tensors)."""
    return {k: v for k, v in state_dict.items() if not (cfg.tie_embeddings and k == "output.weight")}


def weights_for_save(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Contiguous CPU fp32 tensors, the tied head dropped (CPU fp32 ones are not copied)."""
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in drop_tied(state_dict, cfg).items()}


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


def write(run_dir: Path, step: int, *, weights: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Tokenizer,
          optim_tensors: dict[str, torch.Tensor] | None = None, rng: dict[str, torch.Tensor] | None = None,
          state: dict | None = None, keep_last: int = 0, keep: Container[int] = ()) -> Path:
    """save() without the finite check (the caller has made it): the atomic write and the pruning."""
    ckpt_root = Path(run_dir) / layout.CHECKPOINTS
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}"
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_root.glob(TMP_PREFIX + "*"):  # left behind by a save that was killed mid-way
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        save_safetensors(_host(weights), tmp / MODEL_FILE,  # the user's umask, not safetensors' 0600
                         metadata={"format": "pt", "prodip_format": str(FORMAT_VERSION)})
        extra = _host(optim_tensors or {})
        extra.update(_host({RNG_PREFIX + k: v for k, v in (rng or {}).items()}))
        if extra:
            save_safetensors(extra, tmp / OPTIM_FILE)
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
    except (OSError, SafetensorError) as e:  # e.g. a full disk: one clear line, older checkpoints untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {step} in {ckpt_root} ({e}); the previous checkpoints "
                              "are intact: free some space, then run the same command again to resume") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            if step_of(old) not in keep:
                remove(old)
    return final


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

    def _stage(self, prefix: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None
               ) -> dict[str, torch.Tensor]:
        """Host copies of `tensors` in this writer's buffers: pinned and non-blocking from a GPU."""
        out = {}
        for k, v in tensors.items():
            v = v.detach()
            want = dtype if dtype is not None and v.is_floating_point() else v.dtype
            buf = self._buffers.get(prefix + k)
            if buf is None or buf.shape != v.shape or buf.dtype != want:
                buf = torch.empty(v.shape, dtype=want, pin_memory=v.is_cuda)
                self._buffers[prefix + k] = buf
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


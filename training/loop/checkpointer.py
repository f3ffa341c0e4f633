"""Checkpointer: the newest complete checkpoint, an exact resume, saves (async, keep-N), on its cadence.

What a checkpoint's state.json holds beyond the model, optimizer and RNG tensors is collected from the
components it is built with (`parts`: `state_dict()` at save, `load_state_dict()` at resume; key None
merges the component's keys at the top level), never packed by hand. Rank 0 alone
writes (training.checkpoint.checkpoint_io.CheckpointWriter, on a background thread unless --no-async-checkpoints);
every rank gathers and learns of a failed write. Under FSDP2 every rank writes its own shards instead
(nothing gathered; synchronous), and rank 0 commits the folder (`_save_sharded`). Nothing is written
by find_latest or resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import sys
import time
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from training import distributed as D
from training import optim
from training.checkpoint import checkpoint_io as ckpt
from training.checkpoint import fsdp_shards as shards
from training.config_sections import CheckpointSection
from training.loop.rank_agreement import USER_ERRORS, TrainError, agreed
from training.loop.run_lock import RunLock
from training.loop.step import ModelViews
from training.mirror import node_caches as mirror_nodes
from training.mirror.run_mirror import Mirror
from training.run_context import RunContext
from training.runfiles import layout
from training.text.tokenizer import Tokenizer

# settings a resume must share with the run it continues: another one would not continue it exactly
EXACT_SETTINGS = ("seed", "seq_len", "batch_size")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


Part = tuple[str | None, Stateful, str]  # (state.json key or None, the component, what it is, for errors)


class Checkpointer:  # built whole: the state.json parts, keep-N's exceptions, a URL --out's mirror
    def __init__(self, section: CheckpointSection, ctx: RunContext, *, parts: Iterable[Part] = (),
                 keep: Callable[[], Container[int]] = tuple, mirror: Mirror | None = None):
        self.cfg, self.out, self.dist, self.device, self.kind = section, ctx.out, ctx.dist, ctx.device, ctx.kind
        self.log, self.say = ctx.log, ctx.say  # a --reset-optimizer resume is recorded in log.jsonl and said
        self.writer = ckpt.CheckpointWriter(asynchronous=section.async_checkpoints)  # rank 0 alone writes with it
        # FSDP2: every rank writes its own shards (no gather); the writer then only keeps the timings
        self.sharded = bool(section.fsdp and ctx.dist.enabled and section.fsdp_sharded_checkpoints)
        self.components: tuple[tuple[str | None, str, Stateful], ...] = tuple(
            (key, what or str(key), part) for key, part, what in parts)
        self.saved_step = 0
        self.keep = keep  # steps keep-N must not prune (the best, early stopping)
        self.mirror = mirror  # a URL --out: each save, once handed to the writer, is uploaded
        self.landing: dict | None = None  # rank 0: the save whose write is in flight, logged once it lands
        self.run_lock = RunLock(self.out)  # rank 0's hold on the run folder, from pull_remote() to close_mirror()

    # ---------------------------------------------------------------- a URL --out (training.mirror.run_mirror)
    def pull_remote(self, model_cfg: Any, force: bool) -> None:
        """First the run folder's lock (loop.run_lock): rank 0, the one writer, holds it for the run's life,
        taken before anything reads or pulls into the folder; another run holding it is refused by name,
        on every rank. Then a URL --out: it holds this run or nothing (else refused); its newest committed
        checkpoint pulled into the cache; on several nodes rank 0's resume checkpoint into every node's
        cache (loop.mirror_nodes)."""
        agreed(self.dist, self.device, f"locking the run folder {self.out}",
               lambda: self.run_lock.acquire() if self.dist.is_main and not self.out.is_file() else None)
        if (m := self.mirror) is not None:
            agreed(self.dist, self.device, f"reading --out {m.url}",
                   lambda: m.prepare(model_cfg, force) if self.dist.is_main else None)
            mirror_nodes.share(m, model_cfg, self.device)

    def start_mirror(self) -> None:
        """Uploads start once the run folder is written: nothing before the checks."""
        if (m := self.mirror) is not None:
            m.start(keep=self.keep)
            m.run_files()

    def close_mirror(self, allow_local_only: bool) -> str:
        """The end of the run (the Trainer's last call, after the log's): the last uploads waited for, then
        the run folder let go (its lock); why the run must still fail ('' when it need not)."""
        try:
            return self.mirror.close(allow_local_only) if self.mirror is not None else ""
        finally:
            self.run_lock.release()

    def should_save(self, step: int, *, last: bool, stopping: bool, new_best: bool) -> bool:
        every = self.cfg.save_every
        return bool((every and step % every == 0) or last or stopping or new_best)

    # ------------------------------------------------------------------------------------ find
    def find_latest(self, tokenizer_sha: str, total_steps: int) -> Path | None:
        """This rank's newest complete checkpoint, checked to resume this run exactly (headers only)."""
        latest = ckpt.latest(self.out)
        if latest is None:
            return None
        st = ckpt.read_state(latest, ckpt.RESUME_STATE_SCHEMA)
        if not ckpt.has_weights(latest):
            raise ckpt.CheckpointError(f"cannot resume {latest}: {latest / ckpt.MODEL_FILE} (the model weights) "
                                       "not found; delete that checkpoint to resume from the one before")
        ckpt.check_readable(latest)  # headers only, cheap: a truncated file fails before anything is loaded
        if st["tokenizer_sha256"] != tokenizer_sha:
            raise TrainError(f"cannot resume {latest}: it was trained with another tokenizer than "
                             f"{self.cfg.data}/{layout.TOKENIZER} (data prepared with a different tokenizer); "
                             "use the original data or another --out")
        was = st.get("train") if isinstance(st.get("train"), dict) else {}
        for key in EXACT_SETTINGS:
            if key in was and was[key] != getattr(self.cfg, key):
                flag = "--" + key.replace("_", "-")
                raise TrainError(f"cannot resume {latest} exactly: it was trained with {flag} {was[key]} (this "
                                 f"command: {flag} {getattr(self.cfg, key)}); use {flag} {was[key]}, or another --out")
        if st["step"] > total_steps:  # a budget below what the run has trained: refused, nothing rewritten
            cfg = self.cfg
            flag = f"--max-steps {cfg.max_steps}" if cfg.max_steps else f"--max-tokens {cfg.max_tokens} ({total_steps} steps)"
            raise TrainError(f"{flag} is below step {st['step']}, where {self.out} already is; give a larger "
                             "budget to train on, or use another --out")
        return latest

    def init_from(self, model: torch.nn.Module, tokenizer_sha: str, path: str | Path = "") -> Path:
        """--init: the weights of another run's checkpoint, of the same model and tokenizer (`path`: where a
        URL --init was pulled)."""
        init = ckpt.load(path or self.cfg.init)
        if init.config.to_dict() != model.cfg.to_dict():
            raise TrainError(f"--init {self.cfg.init}: its model config differs from this run's")
        if init.tokenizer.sha256 != tokenizer_sha:
            raise TrainError(f"--init {self.cfg.init} was trained with another tokenizer than this data's")
        ckpt.load_weights(model, init.weights)
        return init.path

    @staticmethod
    def fingerprint(path: Path | None) -> str:
        return "" if path is None else hashlib.sha256((path / ckpt.STATE_FILE).read_bytes()).hexdigest()

    # ---------------------------------------------------------------------------------- resume
    def resume(self, path: Path, views: ModelViews) -> int:
        """Load the checkpoint into the model, optimizer, RNG and the registered components: exactly, or
        CheckpointError naming the file; its step. Nothing is written (a --reset-optimizer event waits
        in the log's queue).

        Under torchrun rank 0 alone reads and checks the tensors and broadcasts them one at a time
        (D.load_full_state(from_rank0=True)): the other ranks read only state.json and the RNG state."""
        d = self.dist

        def read() -> tuple[dict, dict, dict | None, dict, str | None]:
            state = ckpt.read_state(path, ckpt.RESUME_STATE_SCHEMA)
            if d.is_main:
                return (state, *self._read_tensors(path, state, views))
            return state, {}, None, self._read_rng(path), None

        state, weights, optim_sd, rng, problem = agreed(d, self.device, f"reading {path}", read)
        # rank 0's decisions: is there an optimizer state to load, and an RNG state to restore
        load_optim, restore_rng = d.broadcast_ints([int(optim_sd is not None), int(bool(rng))], self.device)
        try:
            D.load_full_state(views.wrapped, views.optimizer if load_optim else None, weights, optim_sd,
                              from_rank0=d.enabled)
        except (KeyError, ValueError, RuntimeError) as e:
            raise ckpt.CheckpointError(f"cannot resume {path}: its optimizer state does not fit ({e})") from None
        del weights, optim_sd
        for key, what, component in self.components:
            try:
                component.load_state_dict(state if key is None else state[key])
            except (KeyError, TypeError) as e:
                raise ckpt.CheckpointError(f"{path / ckpt.STATE_FILE}: damaged {what} ({e!r})") from None
        rng_restored = bool(rng and restore_rng)
        if rng_restored:
            optim.set_rng_state(rng, self.device)
        self.saved_step = state["step"]
        if self.cfg.reset_optimizer:
            reason = problem or "requested (--reset-optimizer)"
            self.log({"event": "reset_optimizer", "step": state["step"], "reason": reason, "rng_restored": rng_restored})
            self.say(f"warning: resuming {path} with fresh optimizer moments: {reason}")
        self.say(f"resumed from {path} (step {state['step']}, {state['tokens']:,} tokens)")
        return state["step"]

    def _read_tensors(self, path: Path, state: dict, views: ModelViews) -> tuple[dict, dict | None, dict, str | None]:
        """Rank 0's read: (weights, *_read_optimizer), every tensor checked against the model."""
        ck = ckpt.load(path)  # its weights checked against its config: names, shapes, dtype
        if ck.config.to_dict() != views.model.cfg.to_dict():
            raise ckpt.CheckpointError(f"cannot resume {path}: its {ckpt.CONFIG_FILE} differs from the run's "
                                       "model config")
        return (ck.weights, *self._read_optimizer(ck, state, views))

    def _read_optimizer(self, ck: ckpt.Checkpoint, state: dict, views: ModelViews) -> tuple[dict | None, dict, str | None]:
        """(optimizer state or None, RNG, why dropped under --reset-optimizer), checked against the model."""
        path, optim_sd, rng, problem = ck.path, None, {}, None
        try:
            optim_tensors, rng = ck.optimizer_and_rng(strict=True)
            groups = state.get("optimizer_param_groups")
            if not isinstance(groups, list):
                raise ckpt.CheckpointError(f"{path / ckpt.STATE_FILE}: no optimizer_param_groups")
            ckpt.check_optimizer_fits(views.trainable, optim_tensors, rng, path / ckpt.OPTIM_FILE)
            optim_sd = ckpt.unflatten_optimizer(optim_tensors, groups, None)
        except ckpt.CheckpointError as e:
            if not self.cfg.reset_optimizer:
                raise ckpt.CheckpointError(f"cannot resume {path} exactly: {e}; --reset-optimizer resumes it with "
                                           "fresh optimizer moments (recorded in log.jsonl)") from None
            problem, rng = str(e), {}
        return (None if self.cfg.reset_optimizer else optim_sd), rng, problem

    @staticmethod
    def _read_rng(path: Path) -> dict[str, torch.Tensor]:
        """The RNG states alone from a checkpoint's optimizer file (the other ranks' share of a resume)."""
        from safetensors import SafetensorError, safe_open

        if ckpt.is_sharded(path):  # rank 0's RNG states, from its shard file: headers and those tensors only
            with ckpt.ShardedReader(path, "optim") as r:
                return {k[len(ckpt.RNG_PREFIX):]: r.get_tensor(k) for k in r.names if k.startswith(ckpt.RNG_PREFIX)}
        f = path / ckpt.OPTIM_FILE
        if not f.is_file():
            return {}
        try:
            with safe_open(str(f), framework="pt") as st:
                keys = [k for k in st.keys() if k.startswith(ckpt.RNG_PREFIX)]  # noqa: SIM118 (not a dict)
                return {k[len(ckpt.RNG_PREFIX):]: st.get_tensor(k) for k in keys}
        except (SafetensorError, OSError, ValueError) as e:
            raise ckpt.CheckpointError(ckpt.unreadable_tensors(f, e)) from None

    # ------------------------------------------------------------------------------------ save
    def save(self, step: int, views: ModelViews, tokenizer: Tokenizer) -> None:
        """A complete checkpoint of this step (atomic; see training.checkpoint.checkpoint_io). Every rank calls it:
        gathering FSDP2 shards is a collective. The previous write must have succeeded (every rank learns if not)."""
        d = self.dist
        self.finish()
        t0 = time.perf_counter()  # the training thread's stall, from here to the barrier
        bad = ckpt.nonfinite(local_state(views))  # on the device, before anything is gathered or copied
        if d.any(bool(bad), self.device):
            raise ckpt.CheckpointError(f"refusing to save step {step}: "
                                       f"{bad[0] if bad else 'a tensor on another rank'} holds non-finite values")
        if self.sharded:
            self._save_sharded(step, views, tokenizer, t0)
            return
        # single process and DDP: the live tensors on the device (the writer copies them to pinned host
        # memory); FSDP2: gathered to CPU on rank 0, one tensor at a time (no full copy on the GPU)
        offload = self.cfg.fsdp and d.enabled
        weights = D.full_model_state(views.wrapped, rank0_only=offload)
        optim_sd = D.full_optimizer_state(views.wrapped, views.optimizer, rank0_only=offload)
        if d.is_main:
            tensors, groups = ckpt.flatten_optimizer(optim_sd, [])
            model_cfg = views.model.cfg
            self.writer.save(self.out, step, weights=ckpt.drop_tied(weights, model_cfg), cfg=model_cfg,
                             tokenizer=tokenizer, optim_tensors=tensors, rng=optim.rng_state(self.device),
                             state=self._state(groups), keep_last=self.cfg.keep_last, keep=self.keep(), fresh=offload,
                             checked=True)
            if self.mirror is not None:
                self.mirror.checkpoint(step)
        d.barrier()
        self.saved_step = step
        if d.is_main:
            self.landing = {"step": step, "stall_ms": round((time.perf_counter() - t0) * 1e3, 3)}
            if not self.cfg.async_checkpoints:  # written already: its event need not wait for the next finish()
                self._log_landed(0.0)

    def reserve(self, views: ModelViews) -> None:
        """The async writer's host buffers (pinned on a GPU) allocated now, once the first step has made the
        optimizer's moments, not inside the first save (a preemption's, with seconds of grace). Single
        process and DDP only: FSDP2's saves gather into fresh host copies or write their own shards."""
        if self.cfg.fsdp and self.dist.enabled:
            return
        weights = D.full_model_state(views.wrapped)  # references to the live tensors: nothing is copied
        tensors, _ = ckpt.flatten_optimizer(D.full_optimizer_state(views.wrapped, views.optimizer, rank0_only=False), [])
        if self.dist.is_main:
            self.writer.reserve(ckpt.drop_tied(weights, views.model.cfg), tensors)

    def _state(self, groups: list[dict]) -> dict[str, Any]:
        """state.json's contents beyond step and tokenizer: the registered components' states."""
        state: dict[str, Any] = {"kind": self.kind, "optimizer_param_groups": groups,
                                 "world_size": self.dist.world_size, "train": dict(self.cfg.settings)}
        for key, _, component in self.components:
            part = component.state_dict()
            state.update(part if key is None else {key: part})
        return state

    def _save_sharded(self, step: int, views: ModelViews, tokenizer: Tokenizer, t0: float) -> None:
        """FSDP2: every rank writes its own shards into one temporary folder, nothing is gathered; then
        rank 0 writes the index and the JSON files and renames the folder into place (atomic as ever).
        Synchronous on every rank (a background write would need the ranks to agree on its end off the
        training thread); each rank writes only 1/world of the state. Three small collectives order it."""
        d, dev, model_cfg = self.dist, self.device, views.model.cfg
        drop = {"output.weight"} if model_cfg.tie_embeddings else set()

        def local() -> shards.ShardedState:
            D.reshard(views.model)  # parameters() are this rank's shards again (a no-op after a backward)
            try:
                return shards.sharded_state(views.model, views.optimizer, d.rank, drop)
            except ValueError as e:
                raise ckpt.CheckpointError(f"cannot save checkpoint {step} sharded ({e}); "
                                           "--no-fsdp-sharded-checkpoints gathers it to rank 0 instead") from None

        st = agreed(d, dev, f"collecting checkpoint {step}'s shards", local)
        rng = optim.rng_state(dev) if d.is_main else {}
        index = ckpt.shard_index(d.world_size, st.layout, rng_names=list(rng))
        tmp = ckpt.sharded_tmp(self.out, step)
        t_write = time.perf_counter()
        agreed(d, dev, f"starting checkpoint {step}", lambda: ckpt.begin_sharded(self.out, step) if d.is_main else None)
        try:
            writes = ckpt.shard_file("model", d.rank, d.world_size) in index["files"]  # not an HSDP replica
            agreed(d, dev, f"writing checkpoint {step}'s shards",
                   lambda: ckpt.write_shard(tmp, step, d.rank, d.world_size, weights=st.weights, optim_tensors=st.optim,
                                            rng=rng) if writes else None)
            agreed(d, dev, f"committing checkpoint {step}",
                   lambda: ckpt.commit_sharded(self.out, step, tmp, index=index, cfg=model_cfg, tokenizer=tokenizer,
                                               state=self._state(st.param_groups), keep_last=self.cfg.keep_last,
                                               keep=self.keep()) if d.is_main else None)
        except BaseException:
            if d.is_main:  # every rank has stopped writing into it: agreed() is a collective
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.saved_step = step
        if d.is_main:
            if self.mirror is not None:
                self.mirror.checkpoint(step)
            self.writer.write_s.append(time.perf_counter() - t_write)
            self.writer.stall_s.append(time.perf_counter() - t0)
            self.landing = {"step": step, "stall_ms": round((time.perf_counter() - t0) * 1e3, 3), "sharded": True}
            self._log_landed(0.0)  # on disk already

    def finish(self, then: Callable[[], None] | None = None) -> None:
        """Block until rank 0's write in flight is on disk; its error is raised on every rank (one tiny
        collective), so no rank trains on, or exits, while rank 0 is still writing. `then` runs between
        the wait and the collective."""
        error = None
        if self.dist.is_main:
            t0 = time.perf_counter()
            try:
                self.writer.wait()
            except Exception as e:  # a CheckpointError, or any other failure of the writer thread
                error, self.landing = e, None
            self._log_landed(time.perf_counter() - t0)
        if then is not None:
            then()
        if self.dist.any(error is not None, self.device):
            raise error or ckpt.CheckpointError("rank 0 could not write a checkpoint; see its error")

    def close(self) -> None:
        """However the run ends: the last write waited for; its error raised unless another is on its way out."""
        if sys.exc_info()[0] is None:
            self.writer.close()
        else:
            with contextlib.suppress(ckpt.CheckpointError):
                self.writer.close()

    def _log_landed(self, waited_s: float) -> None:
        """The event of the save just on disk, in log.jsonl: `stall_ms` the training thread spent in save()
        (finite check, gather, copy to host, barrier; the whole write when synchronous), `write_s` the write's
        own seconds (the writer thread's when asynchronous), `wait_ms` how long the loop later blocked for it
        to land (0 when the write hid behind training steps), `bytes` its files' sizes on disk."""
        rec, self.landing = self.landing, None
        if rec is None or not self.writer.write_s:
            return
        path = self.out / layout.CHECKPOINTS / ckpt.step_dir_name(rec["step"])
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else 0
        self.log({"event": "checkpoint", **rec, "write_s": round(self.writer.write_s[-1], 4),
                  "wait_ms": round(waited_s * 1e3, 3), "bytes": size,
                  "async": self.cfg.async_checkpoints and not rec.get("sharded", False)})  # sharded: synchronous

    def timings(self) -> dict:
        """Seconds the loop was blocked per save, and each write's own seconds (for the summary)."""
        w = self.writer
        if not w.stall_s:
            return {}
        return {"checkpoint_stall_s": [round(t, 4) for t in w.stall_s],
                "checkpoint_write_s": [round(t, 4) for t in w.write_s]}


def local_state(views: ModelViews) -> dict[str, torch.Tensor]:
    """This rank's weights and optimizer moments where they live (FSDP2: the local shards)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    out = {}
    for name, p in views.model.named_parameters():
        out[name] = local(p.detach())
        for moment, v in views.optimizer.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"{name}/{moment}"] = local(v)
    return out


__all__ = ["USER_ERRORS", "Checkpointer", "local_state"]

"""The training loop as a small Trainer: setup, preflight, step, runtime checks, validate, save.

    Trainer(cfg, pretraining_data).run()                       training/train.py
    Trainer(cfg, sft_data.training_data, kind="sft").run()     training/sft.py

Running the same command again resumes from the newest checkpoint, exactly: the data position,
optimizer moments, schedule and RNG states are restored, and log.jsonl continues as if the run had
never stopped. A checkpoint with any of those missing or unreadable is refused, naming the file;
`--reset-optimizer` resumes it with fresh optimizer moments instead, and log.jsonl records that.
Pre-flight gates (training.gates) must pass before step 1.

Nothing is written until everything is checked: configuration, data, the model (and --init), the run
folder and the whole resume source are read and validated first, and the pre-flight gates pass; only
then does `commit()` write run.json, the tokenizer, gates.json and log.jsonl. A run that fails before
step 1 leaves an existing run folder byte-identical (a failed gate report goes to a folder that holds
no run yet, so the user can read it; a new attempt may reuse such a folder).

Early stopping (--early-stop-patience N): after N evaluations without a new best validation loss the
run stops; every new best is checkpointed (and never pruned), the checkpoints after it are removed,
so the newest checkpoint, the one export and serving take, is the best one. RUN_DIR/early_stop.json
and a log.jsonl event record the decision; running the same command again then has nothing to do.

Each phase is one method and what outlives a step lives on the object, so later work (prefetched
batches, asynchronous checkpoints, SIGTERM handling) replaces a method rather than rewriting the loop.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from training import checkpoint as ckpt
from training import distributed as D
from training import gates, layout, optim
from training.config import ConfigError, TrainConfig
from training.data import Batch, DataError, TrainingData
from training.metrics import StepLog, Throughput, flops_per_token, fmt_duration, mfu_flops, peak_flops
from training.model import Transformer, count_params
from training.schedule import lr_at
from training.schema import SchemaError
from training.tokenizer import TokenizerError
from training.tracking import open_tracker

DataFactory = Callable[[TrainConfig, D.Dist], TrainingData]
RESUME_HINT = "interrupted; resume by running the same command again"
# what a start that failed before commit() can leave in a run folder (a failed gate report; or, if it
# was killed mid-commit, the files written before run.json): such a folder holds no run yet
FAILED_START_LEFTOVERS = frozenset({layout.GATES, layout.LOG, layout.TOKENIZER, layout.NONFINITE, layout.EARLY_STOP,
                                    layout.RUN_CONFIG + ".tmp"})


class TrainError(ValueError):
    pass


# what a training CLI turns into one `error:` line and exit 2 (OSError: a full disk, a missing path)
USER_ERRORS = (ConfigError, SchemaError, DataError, TokenizerError, ckpt.CheckpointError, gates.GateError,
               layout.LayoutError, TrainError, OSError)


def pick_device(name: str, d: D.Dist) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name} but no CUDA device is available")
        return torch.device("cuda", d.local_rank) if name == "cuda" else torch.device(name)
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps but MPS is not available")
    return torch.device(name)


def autocast_for(cfg: TrainConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    if use_bf16:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def _num(x: float) -> float | None:
    return round(x, 2) if math.isfinite(x) else None


@dataclass
class StepResult:
    """One optimizer step before its update: what the runtime checks judge and the log records."""

    lr: float
    loss: float  # mean over micro-batches and ranks
    grad_norm: float  # before clipping
    position: dict  # the data position the step started from (for the non-finite diagnostic)
    spike_z: float | None = None


class Trainer:
    """One run: `run()` = setup, preflight, the loop of steps, the summary.

    `model_class` and `lr_schedule` are the model and schedule to build; the CLIs pass
    training.model.Transformer and training.schedule.lr_at (a test harness passes planted ones)."""

    def __init__(self, cfg: TrainConfig, data_factory: DataFactory, *, kind: str = "pretrain", force: bool = False,
                 model_class: type[Transformer] = Transformer, lr_schedule: optim.Schedule = lr_at):
        self.cfg, self.data_factory, self.kind, self.force = cfg, data_factory, kind, force
        self.model_class, self.lr_schedule = model_class, lr_schedule
        self.out = Path(cfg.out)
        self.log: StepLog | None = None
        self.step = self.saved_step = self.tokens = self.nonfinite_skips = 0
        self.elapsed_before = 0.0  # seconds spent in earlier sessions of a resumed run
        self.last_val: dict | None = None
        self.last_record: dict | None = None
        self.holds_run = self.start_over = False  # what check_run_dir found in RUN_DIR
        self.gate_report: gates.GateReport | None = None
        self.reset_record: dict | None = None  # the log.jsonl event of a --reset-optimizer resume
        # early stopping: best validation so far, kept in every checkpoint's state.json for an exact resume
        self.patience = cfg.early_stop_patience
        self.best: dict = {"val_loss": None, "step": 0, "evals_since": 0}
        self.early_stopped: dict | None = None  # this session's early_stop record
        self.stopped_before: dict | None = None  # RUN_DIR/early_stop.json of an earlier session: nothing to do

    def run(self) -> dict:
        """Run (or resume) training; returns a summary dict."""
        cfg = self.cfg
        self.dist = D.setup("cuda" if (cfg.device == "auto" or cfg.device.startswith("cuda"))
                            and torch.cuda.is_available() else "cpu")
        try:
            self.setup()
            if self.stopped_before is not None:
                return self.already_stopped()
            self.preflight()
            self.commit()
            self.train_loop()
            return self.summary()
        finally:
            if self.log is not None:
                self.log.close()
            D.teardown(self.dist)

    def say(self, *a, **k) -> None:
        if self.dist.is_main:  # rank 0 alone prints
            print(*a, **k)

    # ------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Device, data, model config, the run folder and resume source, model (+ wrap, compile),
        optimizer, and the resume, if any: all read and checked, nothing written."""
        cfg, d = self.cfg, self.dist
        self.device = pick_device(cfg.device, d)
        torch.manual_seed(cfg.seed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.data = self.data_factory(cfg, d)
        self.model_cfg = cfg.model_config(self.data.tokenizer.vocab_size)
        if cfg.seq_len > self.model_cfg.max_seq_len:
            raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {self.model_cfg.max_seq_len}")
        if self.patience and not (self.data.val and cfg.eval_every):
            raise ConfigError(f"--early-stop-patience {self.patience} needs validation: --eval-every > 0 and a "
                              f"validation split in {cfg.data}")
        if self.log_options():  # --log-to: its package is there (nothing is opened or written yet)
            try:
                open_tracker(self.log_options()["log_to"], self.out)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        resume_from = self.check_run_dir()
        if self.stopped_before is not None:
            return
        self.build_model(init_weights=resume_from is None)
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * d.world_size
        self.total_steps = cfg.max_steps or math.ceil(cfg.max_tokens / self.tokens_per_step)
        self.flops_per_token = flops_per_token(self.model_cfg, cfg.seq_len)
        self.peak_flops, gpu_name = peak_flops(self.device)
        mode = "FSDP2" if cfg.fsdp and d.enabled else "DDP" if d.enabled else "single process"
        self.say(f"prodip {self.kind}: {count_params(self.model_cfg) / 1e6:.1f} M params "
                 f"({count_params(self.model_cfg, non_embedding=True) / 1e6:.1f} M non-embedding), {d.world_size}x "
                 f"{gpu_name}, {self.tokens_per_step:,} tokens/step, {self.total_steps:,} steps, {mode}")
        self.resumed = resume_from is not None
        if resume_from is not None:
            self.resume(resume_from)
        self.monitor = gates.RuntimeMonitor(cfg)

    def check_run_dir(self) -> Path | None:
        """Check RUN_DIR against this run (reading only); returns the checkpoint to resume from (or None)."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise TrainError(f"--out {out} is a file, not a run folder; use another --out")
        try:
            old = layout.read_run_config(out)
        except layout.LayoutError as e:
            raise TrainError(f"unreadable run folder: {e}; use another --out or --force") from None
        self.holds_run = old is not None or (out / layout.CHECKPOINTS).exists()
        if old is not None and old.get("model") != self.model_cfg.to_dict():
            if not self.force:
                was = old.get("model") or {}
                diff = {k: (was.get(k), v) for k, v in self.model_cfg.to_dict().items() if was.get(k) != v}
                raise TrainError(f"{out} holds a run with another model config {diff} (old, new); "
                                 "use another --out, or --force to start over there")
            self.start_over = True  # its checkpoints and log are removed by commit(), once all is checked
            return None
        if old is None and out.is_dir() and not self.force and not (out / layout.CHECKPOINTS).exists():
            foreign = sorted(p.name for p in out.iterdir() if p.name not in FAILED_START_LEFTOVERS)
            if foreign:
                more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
                raise TrainError(f"{out} exists and is not a prodip run folder (it holds {foreign[0]!r}{more}); "
                                 "use another --out or --force")
        latest = ckpt.latest(out)
        if latest is None:
            return None
        st = ckpt.read_state(latest, ckpt.RESUME_STATE_SCHEMA)
        if not (latest / ckpt.MODEL_FILE).is_file():
            raise ckpt.CheckpointError(f"cannot resume {latest}: {latest / ckpt.MODEL_FILE} (the model weights) "
                                       "not found; delete that checkpoint to resume from the one before")
        ckpt.check_readable(latest)  # headers only, cheap: a truncated file fails before anything is loaded
        if st["tokenizer_sha256"] != self.data.tokenizer.sha256:
            raise TrainError(f"cannot resume {latest}: it was trained with another tokenizer than "
                             f"{self.cfg.data}/{layout.TOKENIZER} (data prepared with a different tokenizer); "
                             "use the original data or another --out")
        if self.patience and (out / layout.EARLY_STOP).is_file():
            rec = layout.read_json(out / layout.EARLY_STOP, "early-stop record",
                                   required={"step": int, "best_step": int, "patience": int})
            # from the best checkpoint, a patience no larger than the one that stopped stops there again
            if ckpt.step_of(latest) == rec["best_step"] and self.patience <= rec["patience"]:
                self.stopped_before = rec
        return latest

    def log_options(self) -> dict:
        log_to = self.cfg.log_to
        return {"log_to": log_to} if log_to else {}

    def commit(self) -> None:
        """Write the run folder, now that everything is checked: rank 0 alone; run.json atomically and
        after the tokenizer. With --force over another run, its checkpoints and log go first."""
        d = self.dist
        d.barrier()  # every rank has read the run folder before rank 0 writes into it
        if d.is_main:
            if self.start_over:
                shutil.rmtree(self.out / layout.CHECKPOINTS, ignore_errors=True)
                (self.out / layout.LOG).unlink(missing_ok=True)
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / layout.EARLY_STOP).unlink(missing_ok=True)  # training on: an old early stop no longer holds
            if self.gate_report is not None:
                self.gate_report.save(self.out / layout.GATES)
            self.write_run_config()
        self.log = StepLog(self.out / layout.LOG, enabled=d.is_main, **self.log_options())
        self.log.truncate_after(self.step)  # 0 for a fresh run: records of an attempt that never saved go
        if self.reset_record is not None:
            self.log.write(self.reset_record)
        d.barrier()

    def write_run_config(self) -> None:
        """RUN_DIR/run.json (the model and the recipe) and the tokenizer: rank 0, atomically."""
        if not self.dist.is_main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self.data.tokenizer.save(self.out / layout.TOKENIZER)
        key, version = layout.RUN_FORMAT
        run_cfg = {key: version, "kind": self.kind, "model": self.model_cfg.to_dict(), "train": self.cfg.to_dict()}
        tmp = self.out / (layout.RUN_CONFIG + ".tmp")  # a kill mid-write must not leave an unreadable run.json
        tmp.write_text(json.dumps(run_cfg, indent=2, ensure_ascii=False))
        os.replace(tmp, layout.run_config_path(self.out))

    def build_model(self, init_weights: bool) -> None:
        """The model in its three views, and the optimizer. Three, because each job needs another:
        `model`          the Transformer: named parameters, its config, what a checkpoint holds
        `wrapped`        after DDP/FSDP2 (`model` itself single-process and under FSDP2, whose
                         parameters are then sharded DTensors): gradient sync, clipping, full state dicts
        `forward_model`  what a step calls: torch.compile(wrapped) with --compile, else `wrapped`"""
        cfg = self.cfg
        with torch.device("cpu"):
            self.model = self.model_class(self.model_cfg)
        if cfg.init and init_weights:
            init = ckpt.load(cfg.init)
            if init.config.to_dict() != self.model_cfg.to_dict():
                raise TrainError(f"--init {cfg.init}: its model config differs from this run's")
            if init.tokenizer.sha256 != self.data.tokenizer.sha256:
                raise TrainError(f"--init {cfg.init} was trained with another tokenizer than this data's")
            ckpt.load_weights(self.model, init.weights)
            self.say(f"initialized from {init.path}")
        self.model.activation_checkpointing = cfg.activation_checkpointing
        self.model.to(self.device)
        self.wrapped = D.wrap(self.model, self.dist, fsdp=cfg.fsdp, device=self.device)
        self.optimizer = self.new_optimizer(self.wrapped)
        self.forward_model = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        self.autocast = autocast_for(cfg, self.device)
        self.trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def new_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        """The training optimizer, and the one the overfit gate builds for its copy of the model."""
        return optim.make_optimizer(module, self.cfg, self.device)

    def resume(self, path: Path) -> None:
        """Load the checkpoint into the model, optimizer, data position, RNG and counters: exactly, or
        CheckpointError naming the file and what is wrong. Nothing is written here."""
        ck = ckpt.load(path)
        state = ckpt.read_state(path, ckpt.RESUME_STATE_SCHEMA)
        if ck.config.to_dict() != self.model_cfg.to_dict():
            raise ckpt.CheckpointError(f"cannot resume {path}: its {ckpt.CONFIG_FILE} differs from the run's "
                                       "model config")
        ckpt.check_fits(self.model, ck.weights, path / ckpt.MODEL_FILE)
        reset = self.cfg.reset_optimizer
        optim_sd, rng, problem = None, {}, None
        try:
            optim_tensors, rng = ck.optimizer_and_rng(strict=True)
            groups = state.get("optimizer_param_groups")
            if not isinstance(groups, list):
                raise ckpt.CheckpointError(f"{path / ckpt.STATE_FILE}: no optimizer_param_groups")
            ckpt.check_optimizer_fits(self.trainable, optim_tensors, rng, path / ckpt.OPTIM_FILE)
            optim_sd = ckpt.unflatten_optimizer(optim_tensors, groups, None)
        except ckpt.CheckpointError as e:
            if not reset:
                raise ckpt.CheckpointError(f"cannot resume {path} exactly: {e}; --reset-optimizer resumes it with "
                                           "fresh optimizer moments (recorded in log.jsonl)") from None
            problem, rng = str(e), {}
        try:
            D.load_full_state(self.wrapped, None if reset else self.optimizer, ck.weights, optim_sd)
        except (KeyError, ValueError, RuntimeError) as e:
            raise ckpt.CheckpointError(f"cannot resume {path}: its optimizer state does not fit ({e})") from None
        try:
            self.data.train.load_state_dict(state["data"])
        except (KeyError, TypeError) as e:
            raise ckpt.CheckpointError(f"{path / ckpt.STATE_FILE}: damaged data position ({e!r})") from None
        if rng:
            optim.set_rng_state(rng, self.device)
        self.step = self.saved_step = state["step"]
        self.tokens = state["tokens"]
        elapsed = state.get("elapsed_s", 0.0)
        self.elapsed_before = float(elapsed) if isinstance(elapsed, int | float) else 0.0
        best = state.get("early_stop")
        if isinstance(best, dict) and set(best) == set(self.best):
            self.best = dict(best)
        if reset:
            self.reset_record = {"event": "reset_optimizer", "step": self.step,
                                 "reason": problem or "requested (--reset-optimizer)", "rng_restored": bool(rng)}
            self.say(f"warning: resuming {path} with fresh optimizer moments: {self.reset_record['reason']}")
        self.say(f"resumed from {path} (step {self.step}, {self.tokens:,} tokens)")

    # -------------------------------------------------------------------------------- preflight
    def preflight(self) -> None:
        """The pre-flight gates on the exact object that trains; one verdict for every rank. A resumed
        run passed them when it started."""
        if self.resumed:
            return
        cfg, d = self.cfg, self.dist
        report = gates.GateReport(skipped_by_user=list(cfg.skip_gates))
        ctx = gates.PreflightContext(model=self.forward_model, raw_model=self.model, optimizer_factory=self.new_optimizer,
                                     batches=self.data, cfg=cfg, model_cfg=self.model_cfg, device=self.device,
                                     autocast=self.autocast, dist=d, flops_per_token=self.flops_per_token,
                                     peak_flops=self.peak_flops)
        report.extend(gates.run_preflight(ctx, skip=cfg.skip_gates))
        failed_ranks = d.ranks_where(not report.passed, self.device)
        if failed_ranks and report.passed:
            report.results.append(gates.GateResult(
                "all_ranks", False, value=float(len(failed_ranks)), threshold="0",
                detail=f"pre-flight gates failed on rank(s) {failed_ranks}; see their errors"))
        if d.is_main:
            self.say(report.table())
        if not report.passed:
            # the report is the user's to read; a folder that holds a run keeps its own gates.json
            if d.is_main and not self.holds_run:
                self.out.mkdir(parents=True, exist_ok=True)
                report.save(self.out / layout.GATES)
            raise gates.GateError(report)
        self.gate_report = report  # written by commit()
        self.say(report.summary())

    # ------------------------------------------------------------------------------------- loop
    def train_loop(self) -> None:
        cfg = self.cfg
        if self.device.type == "cuda":  # peak_mem_gb in log.jsonl: the training steps' peak, not the gates'
            torch.cuda.reset_peak_memory_stats(self.device)
        # the clock starts here: tokens/s and elapsed_s measure training steps, not set-up and gates
        self.throughput = Throughput(mfu_flops(self.model_cfg, cfg.seq_len), self.peak_flops, self.dist.world_size,
                                     cfg.gpu_hourly_usd)
        self.throughput.elapsed_before = self.elapsed_before
        self.throughput.update(self.tokens)
        start = self.step
        while self.step < self.total_steps:
            self.step += 1
            result = self.train_step()
            if not self.runtime_checks(result):  # the batch's update is dropped; its tokens still count
                self.tokens += self.tokens_per_step
                continue
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.tokens += self.tokens_per_step
            self.throughput.update(self.tokens)
            rec = self.record(result)
            new_best = evaluated = False
            if self.data.val and cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == self.total_steps):
                self.last_val = self.validate()
                rec.update(self.last_val)
                new_best, evaluated = self.track_best(self.last_val["val_loss"]), True
            self.log.write(rec)
            self.last_record = rec
            if self.step % cfg.log_every == 0 or self.step == self.total_steps or self.step == start + 1:
                self.say(self.progress_line(rec))
            if evaluated and self.patience and self.best["evals_since"] >= self.patience:
                self.stop_early()
                return
            stopping = cfg.stop_at and self.step >= cfg.stop_at
            if ((cfg.save_every and self.step % cfg.save_every == 0) or self.step == self.total_steps or stopping
                    or (new_best and self.patience)):
                self.save()
            if stopping:
                self.say(f"stopping at step {self.step} (--stop-at); run the same command without it to continue")
                break
        if self.step > self.saved_step:  # the last step's batch was skipped (non-finite/spike): still end on a checkpoint
            self.save()

    # ------------------------------------------------------------------------------- early stop
    def track_best(self, val_loss: float) -> bool:
        """Update the best validation loss so far; True when `val_loss` is a new best."""
        b = self.best
        if b["val_loss"] is None or val_loss < b["val_loss"]:
            b.update(val_loss=val_loss, step=self.step, evals_since=0)
            return True
        b["evals_since"] += 1
        return False

    def stop_early(self) -> None:
        """`patience` evaluations without a new best: stop here. The checkpoints after the best one are
        removed, so the newest checkpoint is the best; early_stop.json and log.jsonl say so."""
        b, d = self.best, self.dist
        best_ckpt = self.out / layout.CHECKPOINTS / ckpt.step_dir_name(b["step"])
        kept = best_ckpt.is_dir()  # False only if early stopping was switched on mid-run, after the best step
        removed = []
        if d.is_main and kept:
            for c in ckpt.list_checkpoints(self.out):
                if ckpt.step_of(c) > b["step"]:
                    ckpt.remove(c)
                    removed.append(c.name)
        rec = {"event": "early_stop", "step": self.step, "best_step": b["step"], "best_val_loss": b["val_loss"],
               "patience": self.patience, "best_checkpoint": best_ckpt.name if kept else None,
               "removed_checkpoints": removed}
        if d.is_main:
            tmp = self.out / (layout.EARLY_STOP + ".tmp")
            tmp.write_text(json.dumps(rec, indent=2) + "\n")
            os.replace(tmp, self.out / layout.EARLY_STOP)
            self.log.write(rec)
        d.barrier()
        self.early_stopped = rec
        where = (f"checkpoint {best_ckpt.name} is now the newest" if kept else
                 "no checkpoint of that step exists (early stopping was switched on later); the newest is kept")
        self.say(f"early stop at step {self.step}: no better validation loss in {self.patience} evaluations; best "
                 f"{b['val_loss']:.4f} at step {b['step']}; {where}")

    def already_stopped(self) -> dict:
        rec = self.stopped_before or {}
        self.say(f"{self.out} already stopped early at step {rec['step']} (best validation at step "
                 f"{rec['best_step']}, its newest checkpoint) with patience {rec['patience']}; nothing to do. To "
                 "train on from there, run with --early-stop-patience 0 or a larger patience")
        return {"step": rec["best_step"], "run_dir": str(self.out), "early_stop": rec}

    def train_step(self) -> StepResult:
        """Forward/backward over grad_accum micro-batches; gradients accumulated, not yet applied."""
        cfg, d = self.cfg, self.dist
        lr = optim.lr_for_step(cfg, self.step, self.total_steps, self.lr_schedule)
        optim.set_lr(self.optimizer, lr)
        position = self.data.train.state_dict()
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y, mask = self.to_device(self.data.train.next_batch(cfg.batch_size))
            sync = D.grad_sync(self.wrapped, d, fsdp=cfg.fsdp, last_micro=micro == cfg.grad_accum - 1)
            with sync:  # entered once: DDP's no_sync() cannot be re-entered
                with self.autocast():
                    _, loss = self.forward_model(x, y, loss_mask=mask)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        loss_val = d.mean(loss_sum / cfg.grad_accum).item()
        # a non-finite norm leaves the gradients as they are, for the diagnostic to name the parameter
        norm = gates.clip_grad_norm_finite(self.wrapped.parameters(), cfg.grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        return StepResult(lr, loss_val, grad_norm, position)

    def to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x, y = batch[0].to(self.device), batch[1].to(self.device)
        return x, y, batch[2].to(self.device) if len(batch) > 2 else None

    # ------------------------------------------------------------------------------ runtime checks
    def runtime_checks(self, r: StepResult) -> bool:
        """The runtime gates, before the update: False drops this step's update (--on-nonfinite skip,
        --on-spike skip); a failure that must stop the run raises GateError with the weights untouched."""
        cfg, d, step = self.cfg, self.dist, self.step
        if d.any(not (math.isfinite(r.loss) and math.isfinite(r.grad_norm)), self.device):
            diag = self.monitor.nonfinite_diagnostic(step, r.loss, r.grad_norm, self.trainable, r.position)
            if d.is_main:
                (self.out / layout.NONFINITE).write_text(json.dumps(diag, indent=2))
                self.log.write({"event": "nonfinite", **diag})
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_skips += 1
            if cfg.on_nonfinite == "skip" and self.nonfinite_skips <= cfg.max_nonfinite_skips:
                self.say(f"warning: step {step}: non-finite loss/grad ({diag['detail']}); batch skipped "
                         f"({self.nonfinite_skips}/{cfg.max_nonfinite_skips})")
                return False
            raise gates.GateError(f"step {step}: non-finite loss or gradient ({diag['detail']}); stopped before the "
                                  f"optimizer step, weights untouched; diagnostic in {self.out / layout.NONFINITE}")
        if cfg.grad_flow_every and step % cfg.grad_flow_every == 0:
            flow = gates.gradient_flow_from_grads(self.trainable)
            if not flow.passed:
                raise gates.GateError(f"step {step}: runtime gradient-flow check failed: {flow.detail}")
        r.spike_z = self.monitor.observe(step, r.loss)
        if r.spike_z and cfg.on_spike == "skip":
            self.optimizer.zero_grad(set_to_none=True)
            self.log.write({"event": "loss_spike_skipped", "step": step, "loss": r.loss, "loss_spike_z": r.spike_z})
            self.say(f"warning: step {step}: loss spike (z={r.spike_z:.1f}); batch skipped (--on-spike skip)")
            return False
        if r.spike_z:
            self.say(f"warning: step {step}: loss spike (z={r.spike_z:.1f})")
        return True

    # --------------------------------------------------------------------------- validate, record
    @torch.no_grad()
    def validate(self) -> dict:
        """Mean loss over the fixed validation batches (all ranks), and bits per byte when known."""
        fwd = self.forward_model
        was = fwd.training
        fwd.eval()
        losses = []
        for batch in self.data.val(self.cfg.eval_batches):
            x, y, mask = self.to_device(batch)
            with self.autocast():
                _, loss = fwd(x, y, loss_mask=mask)
            losses.append(loss.float())
        fwd.train(was)
        val = self.dist.mean(torch.stack(losses).mean()).item()
        out = {"val_loss": val}
        if self.data.bytes_per_token:
            out["val_bpb"] = val / math.log(2) / self.data.bytes_per_token
        return out

    def record(self, r: StepResult) -> dict:
        """The step's log.jsonl record (validation is added by the loop)."""
        thr = self.throughput
        rec = {"step": self.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens": self.tokens,
               "tokens_per_s": _num(thr.tokens_per_s), **thr.mfu_fields(), "elapsed_s": round(thr.elapsed, 3)}
        if self.device.type == "cuda":
            rec["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        if r.spike_z:
            rec["loss_spike_z"] = r.spike_z
        return rec

    def progress_line(self, rec: dict) -> str:
        thr, step, total, val = self.throughput, self.step, self.total_steps, self.last_val
        tps = rec["tokens_per_s"] or float("nan")
        remaining = (total - step) * (thr.elapsed / max(step, 1)) if step else float("nan")
        parts = [f"step {step}/{total}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}",
                 f"gnorm {rec['grad_norm']:.2f}", f"{tps:,.0f} tok/s"]
        if rec["mfu"] is not None:
            parts.append(f"MFU {rec['mfu'] * 100:.1f}%")
        if val:
            parts.append(f"val {val['val_loss']:.4f}" + (f" ({val['val_bpb']:.3f} bpb)" if "val_bpb" in val else ""))
        parts.append(f"ETA {fmt_duration(remaining)}")
        if thr.hourly:
            parts.append(f"${thr.cost(thr.elapsed):.2f} so far, ${thr.cost(thr.elapsed + remaining):.2f} projected")
        return " | ".join(parts)

    # ------------------------------------------------------------------------------------- save
    def save(self) -> None:
        """A complete checkpoint of this step (atomic; see training.checkpoint). Every rank calls it:
        gathering FSDP2 shards is a collective; rank 0 alone writes."""
        d = self.dist
        weights = D.full_model_state(self.wrapped, rank0_only=True)
        optim_sd = D.full_optimizer_state(self.wrapped, self.optimizer)
        if d.is_main:
            tensors, groups = ckpt.flatten_optimizer(optim_sd, [])
            state = {"kind": self.kind, "tokens": self.tokens, "elapsed_s": self.throughput.elapsed,
                     "data": self.data.train.state_dict(), "optimizer_param_groups": groups,
                     "world_size": d.world_size, "train": self.cfg.to_dict(), "early_stop": dict(self.best)}
            ckpt.save(self.out, self.step, weights=ckpt.weights_for_save(weights, self.model_cfg), cfg=self.model_cfg,
                      tokenizer=self.data.tokenizer, optim_tensors=tensors, rng=optim.rng_state(self.device),
                      state=state, keep_last=self.cfg.keep_last, keep={self.best["step"]} if self.patience else ())
        d.barrier()
        self.saved_step = self.step

    def summary(self) -> dict:
        elapsed = self.throughput.elapsed
        self.say(f"done: {self.step} steps, {self.tokens:,} tokens in {fmt_duration(elapsed)}; run folder {self.out}")
        out = {"step": self.step, "tokens": self.tokens, "elapsed_s": elapsed, "run_dir": str(self.out),
               "final_loss": self.last_record["loss"] if self.last_record else None, **(self.last_val or {})}
        if self.best["val_loss"] is not None:
            out["best_val_loss"], out["best_step"] = self.best["val_loss"], self.best["step"]
        if self.early_stopped is not None:
            out["early_stop"] = self.early_stopped
        return out

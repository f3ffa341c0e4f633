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
import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from training import checkpoint as ckpt
from training import distributed as D
from training import gates, layout, optim, preempt
from training.config import ConfigError, TrainConfig
from training.data import Batch, DataError, Prefetcher, TrainingData
from training.gates.runtime import first_nonfinite_index
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
               layout.LayoutError, TrainError, OSError, D.DistError)


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
    """One optimizer step: what the runtime checks judge and the log records. `loss`, `grad_norm` (and
    `first_bad`) are device tensors until `Trainer.read_records` reads them, then Python numbers."""

    step: int
    lr: float
    loss: torch.Tensor | float  # mean over micro-batches and ranks
    grad_norm: torch.Tensor | float  # before clipping
    position: dict  # the data position the step started from (for the non-finite diagnostic)
    deferred: bool = False  # update applied on the device before the values were read (a non-finite one skipped)
    nonfinite: torch.Tensor | None = None  # deferred: 1.0 when loss or norm is not finite (the device's skip flag)
    first_bad: torch.Tensor | int | None = None  # deferred: index of the first non-finite gradient, -1 if none
    fields: dict = field(default_factory=dict)  # the record's host fields, taken at the step (tokens, timing)
    applied: bool | None = None  # did the update reach the weights: None until judged
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
        self.writer = ckpt.CheckpointWriter(asynchronous=cfg.async_checkpoints)  # rank 0 alone writes with it
        self.preemption: preempt.Preemption | None = None  # SIGTERM/SIGUSR1 handling, during train_loop

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
            self.end_checkpointing()
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
        error = None
        try:  # per rank: a rank that fails here alone must not leave the others in the next collective
            self.data = self.data_factory(cfg, d)
            self.model_cfg = cfg.model_config(self.data.tokenizer.vocab_size)
            if cfg.seq_len > self.model_cfg.max_seq_len:
                raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len "
                                  f"{self.model_cfg.max_seq_len}")
            if self.patience and not (self.data.val and cfg.eval_every):
                raise ConfigError(f"--early-stop-patience {self.patience} needs validation: --eval-every > 0 and a "
                                  f"validation split in {cfg.data}")
            if self.log_options():  # --log-to: its package is there (nothing is opened or written yet)
                try:
                    open_tracker(self.log_options()["log_to"], self.out)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        except USER_ERRORS as e:
            error = e
        d.raise_if_any(error, self.device, f"reading --data {cfg.data}")
        resume_from = self.check_run_dir()
        if self.stopped_before is not None:
            return
        self.build_model(init_weights=resume_from is None)
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * d.world_size
        self.total_steps = cfg.max_steps or math.ceil(cfg.max_tokens / self.tokens_per_step)
        self.flops_per_token = flops_per_token(self.model_cfg, cfg.seq_len)
        self.peak_flops, gpu_name = peak_flops(self.device)
        mesh = D.mesh_shape(d.world_size, d.local_world_size)
        mode = ("single process" if not d.enabled else "DDP" if not cfg.fsdp else "FSDP2" if len(mesh) == 1
                else f"FSDP2 (HSDP {mesh[0]}x{mesh[1]}: replicated across nodes, sharded within one)")
        if d.enabled and cfg.fsdp and self.fsdp_param_dtype is not None:
            mode += ", bf16 all-gathers and compute, fp32 gradient reduction"
        self.say(f"prodip {self.kind}: {count_params(self.model_cfg) / 1e6:.1f} M params "
                 f"({count_params(self.model_cfg, non_embedding=True) / 1e6:.1f} M non-embedding), {d.world_size}x "
                 f"{gpu_name}, {self.tokens_per_step:,} tokens/step, {self.total_steps:,} steps, {mode}")
        self.resumed = resume_from is not None
        if resume_from is not None:
            self.resume(resume_from)
        self.monitor = gates.RuntimeMonitor(cfg)

    def check_run_dir(self) -> Path | None:
        """Check RUN_DIR against this run (reading only); returns the checkpoint to resume from (or None).

        Under torchrun every rank reads the folder, and rank 0's finding is the decision: every rank
        must see the same checkpoint (step and sha256 of its state.json), or every rank stops with
        one line (see distributed.agree_on_view); never a hang, never rank 0 resuming alone."""
        d, error, latest = self.dist, None, None
        try:
            latest = self.read_run_dir()
        except USER_ERRORS as e:
            error = e
        d.raise_if_any(error, self.device, f"reading the run folder {self.out}")
        fingerprint = "" if latest is None else hashlib.sha256((latest / ckpt.STATE_FILE).read_bytes()).hexdigest()
        mine = D.RunView(ckpt.step_of(latest) if latest is not None else -1, fingerprint, self.start_over,
                         self.stopped_before is not None)
        D.agree_on_view(d, mine, self.device, f"--out {self.out}")
        return latest

    def read_run_dir(self) -> Path | None:
        """This rank's reading of RUN_DIR (check_run_dir's first half)."""
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
        self.autocast = autocast_for(cfg, self.device)
        with self.autocast():  # bf16 compute: FSDP2 gathers bf16 weights and reduces gradients in fp32
            param_dtype = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(
                self.device.type) else None
        self.fsdp_param_dtype = param_dtype
        self.wrapped = D.wrap(self.model, self.dist, fsdp=cfg.fsdp, device=self.device, param_dtype=param_dtype,
                              reshard_after_forward=cfg.fsdp_reshard_after_forward)
        self.optimizer = self.new_optimizer(self.wrapped)
        self.forward_model = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        self.trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def new_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        """The training optimizer, and the one the overfit gate builds for its copy of the model."""
        return optim.make_optimizer(module, self.cfg, self.device)

    def resume(self, path: Path) -> None:
        """Load the checkpoint into the model, optimizer, data position, RNG and counters: exactly, or
        CheckpointError naming the file and what is wrong. Nothing is written here.

        Under torchrun rank 0 alone reads and checks the tensors and broadcasts them one at a time
        (D.load_full_state(from_rank0=True)): the other ranks read only state.json and the RNG state,
        so no rank but rank 0 holds the full model and optimizer state in host memory."""
        d = self.dist
        reset = self.cfg.reset_optimizer
        weights: dict = {}
        optim_sd, rng, problem, error = None, {}, None, None
        try:
            state = ckpt.read_state(path, ckpt.RESUME_STATE_SCHEMA)
            if d.is_main:
                weights, optim_sd, rng, problem = self.read_checkpoint(path, state)
            else:
                rng = self.read_rng(path)
        except USER_ERRORS as e:
            error = e
        d.raise_if_any(error, self.device, f"reading {path}")
        # rank 0's decisions: is there an optimizer state to load, and an RNG state to restore
        load_optim, restore_rng = d.broadcast_ints([int(optim_sd is not None), int(bool(rng))], self.device)
        try:
            D.load_full_state(self.wrapped, self.optimizer if load_optim else None, weights, optim_sd,
                              from_rank0=d.enabled)
        except (KeyError, ValueError, RuntimeError) as e:
            raise ckpt.CheckpointError(f"cannot resume {path}: its optimizer state does not fit ({e})") from None
        del weights, optim_sd
        if not restore_rng:
            rng = {}
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

    def read_checkpoint(self, path: Path, state: dict) -> tuple[dict, dict | None, dict, str | None]:
        """Rank 0's read of a checkpoint to resume: (weights, optimizer state or None, RNG, why the
        optimizer state is dropped under --reset-optimizer), every tensor checked against the model."""
        ck = ckpt.load(path)
        if ck.config.to_dict() != self.model_cfg.to_dict():
            raise ckpt.CheckpointError(f"cannot resume {path}: its {ckpt.CONFIG_FILE} differs from the run's "
                                       "model config")
        ckpt.check_fits(self.model, ck.weights, path / ckpt.MODEL_FILE)
        optim_sd, rng, problem = None, {}, None
        try:
            optim_tensors, rng = ck.optimizer_and_rng(strict=True)
            groups = state.get("optimizer_param_groups")
            if not isinstance(groups, list):
                raise ckpt.CheckpointError(f"{path / ckpt.STATE_FILE}: no optimizer_param_groups")
            ckpt.check_optimizer_fits(self.trainable, optim_tensors, rng, path / ckpt.OPTIM_FILE)
            optim_sd = ckpt.unflatten_optimizer(optim_tensors, groups, None)
        except ckpt.CheckpointError as e:
            if not self.cfg.reset_optimizer:
                raise ckpt.CheckpointError(f"cannot resume {path} exactly: {e}; --reset-optimizer resumes it with "
                                           "fresh optimizer moments (recorded in log.jsonl)") from None
            problem, rng = str(e), {}
        if self.cfg.reset_optimizer:
            optim_sd = None
        return ck.weights, optim_sd, rng, problem

    @staticmethod
    def read_rng(path: Path) -> dict[str, torch.Tensor]:
        """The RNG states alone from a checkpoint's optimizer file (the other ranks' share of a resume)."""
        from safetensors import SafetensorError, safe_open

        f = path / ckpt.OPTIM_FILE
        if not f.is_file():
            return {}
        try:
            with safe_open(str(f), framework="pt") as st:
                keys = [k for k in st.keys() if k.startswith(ckpt.RNG_PREFIX)]  # noqa: SIM118 (not a dict)
                return {k[len(ckpt.RNG_PREFIX):]: st.get_tensor(k) for k in keys}
        except (SafetensorError, OSError, ValueError) as e:
            raise ckpt.CheckpointError(ckpt.unreadable_tensors(f, e)) from None

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
        self.preemption = preempt.Preemption(self.dist, self.device).install()
        # one micro-batch drawn ahead, its copy to the device started while the step before computes
        self.data.train = Prefetcher(self.data.train, self.to_device)
        # fused AdamW skips a non-finite update on the device, so loss and grad norm wait on the device
        # for the next read (log, eval, save, stop): one host sync per read, not per step
        self.deferred = optim.uses_fused(cfg, self.device) and not (cfg.fsdp and self.dist.enabled)
        self.pending: list[StepResult] = []  # steps not yet read, oldest first
        self.current: dict | None = None  # the newest step's record, read but not yet written
        while self.step < self.total_steps:
            if signum := self.preemption.poll():  # the same answer on every rank, at the same step
                self.write_current(self.read_records())  # every step's record in log.jsonl before its checkpoint
                self.stop_preempted(signum)
            self.write_current(self.current)  # the step before's record, when no read completed it
            self.step += 1
            result = self.train_step()
            self.tokens += self.tokens_per_step  # a dropped batch's tokens still count
            self.throughput.update(self.tokens)
            result.fields = self.step_fields()
            self.pending.append(result)
            if self.reads_now():  # a check needs this step's values before its update
                self.read_records()
                if result.applied:
                    self.optimizer.step()
            else:
                result.deferred = True
                optim.step_unless(self.optimizer, result.nonfinite)
            self.optimizer.zero_grad(set_to_none=True)
            last = self.step == self.total_steps
            evaluate = bool(self.data.val and cfg.eval_every and (self.step % cfg.eval_every == 0 or last))
            stopping = cfg.stop_at and self.step >= cfg.stop_at
            if not (evaluate or stopping or last or self.step % cfg.log_every == 0 or self.step == start + 1
                    or (cfg.save_every and self.step % cfg.save_every == 0)):
                continue
            rec = self.read_records()  # one host sync for every step since the last read
            if rec is None:  # this step's update was dropped (non-finite or spike)
                continue
            new_best = evaluated = False
            if evaluate:
                self.last_val = self.validate()
                rec.update(self.last_val)
                new_best, evaluated = self.track_best(self.last_val["val_loss"]), True
            self.write_current(rec)
            if self.step % cfg.log_every == 0 or self.step == self.total_steps or self.step == start + 1:
                self.say(self.progress_line(rec))
            if evaluated and self.patience and self.best["evals_since"] >= self.patience:
                self.finish_saves()  # the write in flight must land before the checkpoints after the best go
                self.stop_early()
                return
            if ((cfg.save_every and self.step % cfg.save_every == 0) or self.step == self.total_steps or stopping
                    or (new_best and self.patience)):
                self.save()
            if stopping:
                self.say(f"stopping at step {self.step} (--stop-at); run the same command without it to continue")
                break
        self.write_current(self.read_records())
        if self.step > self.saved_step:  # the last step's batch was skipped (non-finite/spike): still end on a checkpoint
            self.save()

    def reads_now(self) -> bool:
        """Must this step's loss and grad norm be read before its update? Always without the device-side
        skip; with it, only where a check needs them: --on-spike skip, the gradient-flow cadence."""
        cfg = self.cfg
        return (not self.deferred or cfg.on_spike == "skip"
                or bool(cfg.grad_flow_every and self.step % cfg.grad_flow_every == 0))

    def read_records(self) -> dict | None:
        """Read the pending steps' values (one host sync for all of them), run their runtime checks in
        step order and write their log.jsonl records; the current step's record is not written but
        returned (also as `self.current`) for the loop to complete. None when its update was dropped."""
        pending, self.pending = self.pending, []
        todo = [r for r in pending if r.applied is None]
        if todo:
            cols = [torch.stack([r.loss.double(), r.grad_norm.double(),
                                 (r.first_bad if r.first_bad is not None else torch.zeros((), device=r.loss.device)).double()])
                    for r in todo]
            for r, (loss, norm, first) in zip(todo, torch.stack(cols).tolist(), strict=True):
                r.loss, r.grad_norm = loss, norm
                r.first_bad = int(first) if r.first_bad is not None else None
        for r in pending:
            if r.applied is None:
                r.applied = self.runtime_checks(r)
            if not r.applied:
                continue
            if r.step == self.step:
                self.current = self.record(r)
            else:
                self.write_current(self.record(r))
        return self.current

    def write_current(self, rec: dict | None) -> None:
        if rec is not None:
            self.log.write(rec)
            self.last_record = rec
        self.current = None

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
        """Forward/backward over grad_accum micro-batches; gradients accumulated and clipped, not yet
        applied. Loss and grad norm stay on the device (no host sync here)."""
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
                    _, loss = self.forward_model(x, y, loss_mask=mask)  # the loss alone: no logits
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        loss = d.mean(loss_sum / cfg.grad_accum)
        # a non-finite norm leaves the gradients as they are, for the diagnostic to name the parameter
        norm = gates.clip_grad_norm_finite(self.wrapped.parameters(), cfg.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        r = StepResult(self.step, lr, loss, norm, position)
        if not self.reads_now():  # what the device-side skip and a later diagnostic need
            r.nonfinite = (~(torch.isfinite(loss) & torch.isfinite(norm))).float()
            r.first_bad = first_nonfinite_index(self.trainable)
        return r

    def to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A host batch on the device: through pinned memory without blocking on CUDA (the host goes on
        queueing work while it copies); tensors already there pass through."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if self.device.type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(self.device, non_blocking=True)
            return t.to(self.device)

        mask = batch[2] if len(batch) > 2 else None
        return move(batch[0]), move(batch[1]), None if mask is None else move(mask)

    # ------------------------------------------------------------------------------ runtime checks
    def runtime_checks(self, r: StepResult) -> bool:
        """The runtime gates on a step's read values: False drops its update (--on-nonfinite skip,
        --on-spike skip; a deferred step's non-finite update was already skipped on the device); a failure
        that must stop the run raises GateError, no non-finite update having reached the weights."""
        cfg, d, step = self.cfg, self.dist, r.step
        bad = not (math.isfinite(r.loss) and math.isfinite(r.grad_norm))
        # deferred: loss and norm are already the same on every rank (reduced), as was the device's decision
        if bad if r.deferred else d.any(bad, self.device):
            diag = self.monitor.nonfinite_diagnostic(step, r.loss, r.grad_norm, self.trainable, r.position,
                                                     first_index=r.first_bad if r.deferred else None)
            if d.is_main:
                (self.out / layout.NONFINITE).write_text(json.dumps(diag, indent=2))
                self.log.write({"event": "nonfinite", **diag})
            self.nonfinite_skips += 1
            if cfg.on_nonfinite == "skip" and self.nonfinite_skips <= cfg.max_nonfinite_skips:
                self.say(f"warning: step {step}: non-finite loss/grad ({diag['detail']}); batch skipped "
                         f"({self.nonfinite_skips}/{cfg.max_nonfinite_skips})")
                return False
            raise gates.GateError(f"step {step}: non-finite loss or gradient ({diag['detail']}); stopped before the "
                                  f"optimizer step, weights untouched; diagnostic in {self.out / layout.NONFINITE}")
        if not r.deferred and cfg.grad_flow_every and step % cfg.grad_flow_every == 0:
            flow = gates.gradient_flow_from_grads(self.trainable)
            if not flow.passed:
                raise gates.GateError(f"step {step}: runtime gradient-flow check failed: {flow.detail}")
        r.spike_z = self.monitor.observe(step, r.loss)
        if r.spike_z and cfg.on_spike == "skip":  # never deferred: --on-spike skip reads every step
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
                _, loss = fwd(x, y, loss_mask=mask, return_logits=False)  # the chunked loss: no logits held
            losses.append(loss.float())
        fwd.train(was)
        val = self.dist.mean(torch.stack(losses).mean()).item()
        out = {"val_loss": val}
        if self.data.bytes_per_token:
            out["val_bpb"] = val / math.log(2) / self.data.bytes_per_token
        return out

    def step_fields(self) -> dict:
        """The host side of a step's record, taken when the step is queued (its values come later)."""
        thr = self.throughput
        out = {"tokens": self.tokens, "tokens_per_s": _num(thr.tokens_per_s), **thr.mfu_fields(),
               "elapsed_s": round(thr.elapsed, 3)}
        if self.device.type == "cuda":
            out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        return out

    def record(self, r: StepResult) -> dict:
        """The step's log.jsonl record (validation is added by the loop)."""
        rec = {"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, **r.fields}
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
        gathering FSDP2 shards is a collective; rank 0 alone writes, on a background thread unless
        --no-async-checkpoints. The previous write must have succeeded (every rank learns if not)."""
        d = self.dist
        self.finish_saves()
        bad = ckpt.nonfinite(self.local_state())  # on the device, before anything is gathered or copied
        if d.any(bool(bad), self.device):
            raise ckpt.CheckpointError(f"refusing to save step {self.step}: "
                                       f"{bad[0] if bad else 'a tensor on another rank'} holds non-finite values")
        # single process and DDP: the live tensors on the device (the writer copies them to pinned host
        # memory); FSDP2: gathered to CPU on rank 0, one tensor at a time (no full copy on the GPU)
        offload = self.cfg.fsdp and d.enabled
        weights = D.full_model_state(self.wrapped, rank0_only=offload)
        optim_sd = D.full_optimizer_state(self.wrapped, self.optimizer, rank0_only=offload)
        if d.is_main:
            tensors, groups = ckpt.flatten_optimizer(optim_sd, [])
            state = {"kind": self.kind, "tokens": self.tokens, "elapsed_s": self.throughput.elapsed,
                     "data": self.data.train.state_dict(), "optimizer_param_groups": groups,
                     "world_size": d.world_size, "train": self.cfg.to_dict(), "early_stop": dict(self.best)}
            self.writer.save(self.out, self.step, weights=ckpt.drop_tied(weights, self.model_cfg), cfg=self.model_cfg,
                             tokenizer=self.data.tokenizer, optim_tensors=tensors, rng=optim.rng_state(self.device),
                             state=state, keep_last=self.cfg.keep_last, keep={self.best["step"]} if self.patience else (),
                             fresh=offload, checked=True)
        d.barrier()
        self.saved_step = self.step

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights and optimizer moments where they live (FSDP2: the local shards)."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        out = {}
        for name, p in self.model.named_parameters():
            out[name] = local(p.detach())
            for moment, v in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"{name}/{moment}"] = local(v)
        return out

    def finish_saves(self, then: Callable[[], None] | None = None) -> None:
        """Block until rank 0's checkpoint write in flight is on disk; its error is raised on every rank
        (one tiny collective), so no rank trains on, or exits, while rank 0 is still writing. `then`
        runs between the wait and the collective."""
        error = None
        if self.dist.is_main:
            try:
                self.writer.wait()
            except Exception as e:  # a CheckpointError, or any other failure of the writer thread
                error = e
        if then is not None:
            then()
        if self.dist.any(error is not None, self.device):
            raise error or ckpt.CheckpointError("rank 0 could not write a checkpoint; see its error")

    def stop_preempted(self, signum: int) -> None:
        """A preemption signal, agreed by every rank: checkpoint this step (unless it has one), wait
        until it is on disk, and raise preempt.Preempted (exit EXIT_PREEMPTED)."""
        name = preempt.signal_name(signum)
        if self.step > self.saved_step:
            self.save()
        # once it is on disk, further signals are ignored while the process exits: torchrun SIGTERMs the
        # ranks still exiting as soon as one has exited, and each should still exit EXIT_PREEMPTED
        self.finish_saves(then=self.preemption.ignore_signals)
        done = (f"checkpoint {ckpt.step_dir_name(self.step)} written" if self.step else
                "no checkpoint (no step was trained)")
        if self.log is not None:
            self.log.write({"event": "preempted", "step": self.step, "signal": name})
        raise preempt.Preempted(f"preempted at step {self.step} by {name}; {done}; run the same command to resume"
                                if self.dist.is_main else "")

    def end_checkpointing(self) -> None:
        """However the run ends: the signal handlers restored, the last write waited for. A write error is
        raised unless another error is already on its way out (run()'s finally)."""
        if self.preemption is not None:
            self.preemption.restore()
        if sys.exc_info()[0] is None:
            self.writer.close()
        else:
            with contextlib.suppress(ckpt.CheckpointError):
                self.writer.close()

    def summary(self) -> dict:
        self.finish_saves()  # "done" only once the last checkpoint is on disk
        if self.preemption is not None:
            self.preemption.restore()
        elapsed = self.throughput.elapsed
        self.say(f"done: {self.step} steps, {self.tokens:,} tokens in {fmt_duration(elapsed)}; run folder {self.out}")
        out = {"step": self.step, "tokens": self.tokens, "elapsed_s": elapsed, "run_dir": str(self.out),
               "final_loss": self.last_record["loss"] if self.last_record else None, **(self.last_val or {})}
        if self.best["val_loss"] is not None:
            out["best_val_loss"], out["best_step"] = self.best["val_loss"], self.best["step"]
        if self.early_stopped is not None:
            out["early_stop"] = self.early_stopped
        if self.writer.stall_s:  # seconds the loop was blocked per save, and each write's own seconds
            out["checkpoint_stall_s"] = [round(t, 4) for t in self.writer.stall_s]
            out["checkpoint_write_s"] = [round(t, 4) for t in self.writer.write_s]
        return out

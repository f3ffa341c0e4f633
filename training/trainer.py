"""The training loop: a thin Trainer wiring the components of training.loop (one concern each).

    Trainer(cfg, pretraining_data).run()                       training/train.py
    Trainer(cfg, sft_data.training_data, kind="sft").run()     training/sft.py

run() = setup (everything read and checked, nothing written), the pre-flight gates, commit (the run
folder written), the loop, the summary. The same command again resumes the newest checkpoint exactly
or is refused naming why (training.loop.checkpointer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from training import config_sections as sections
from training import distributed as D
from training import optim
from training.checkpoint import checkpoint_io as ckpt
from training.data.loaders import Prefetcher
from training.loop.checkpointer import Checkpointer
from training.loop.early_stopping import EarlyStopping
from training.loop.preemption import PreemptionStop
from training.loop.preflight_runner import Preflight
from training.loop.rank_agreement import USER_ERRORS, TrainError, agreed
from training.loop.run_folder import RunFolder
from training.loop.run_inputs import DataFactory, RunInputs
from training.loop.runtime_checks import RuntimeChecks
from training.loop.step import ModelViews, TrainStep, build_views, pick_device, to_device, total_steps
from training.loop.step_reads import StepReads
from training.loop.validator import Validator
from training.mirror.run_mirror import local_folder
from training.model.decoder import ModelConfig, Transformer
from training.run_context import RunContext
from training.runfiles.gate_results import GateReport
from training.schedule import lr_at
from training.telemetry.metrics_logger import EventLog, MetricsLogger
from training.telemetry.step_metrics import fmt_duration
from training.train_config import TrainConfig

__all__ = ["RESUME_HINT", "USER_ERRORS", "TrainError", "Trainer"]

RESUME_HINT = "interrupted; resume by running the same command again"


@dataclass(frozen=True)
class Recipe:
    """What the CLI asks for beyond the TrainConfig (tests/gates_runner.py plants a model and schedule)."""

    data_factory: DataFactory
    kind: str = "pretrain"
    force: bool = False
    model_class: type[Transformer] = Transformer
    lr_schedule: optim.Schedule = lr_at


class Trainer:
    """One run: `run()` = setup, preflight, commit, the loop of steps, the summary."""
    checkpointer_class, gate_registry = Checkpointer, None  # an adapter run's own: training.lora_run.LoRATrainer

    def __init__(self, cfg: TrainConfig, data_factory: DataFactory, *, kind: str = "pretrain", force: bool = False,
                 model_class: type[Transformer] = Transformer, lr_schedule: optim.Schedule = lr_at):
        self.cfg, self.recipe = cfg, Recipe(data_factory, kind, force, model_class, lr_schedule)
        self.step, self.preemption = 0, None
        self.metrics, self.checkpointer = None, None  # built by setup(); closed by run() if they were

    def run(self) -> dict:
        """Run (or resume) training; returns a summary dict."""
        cfg = self.cfg
        d = D.setup("cuda" if (cfg.device == "auto" or cfg.device.startswith("cuda")) and torch.cuda.is_available()
                    else "cpu")
        try:  # the context every component shares: the device, --out's local folder (a URL's cache), the log
            self.ctx = RunContext(d, pick_device(cfg.device, d), local_folder(sections.MirrorSection.of(cfg)),
                                  self.recipe.kind, log=EventLog(), say=self.say)
            self.setup()
            if self.early.prior is not None:  # this command already stopped early: nothing to do
                return self.early.nothing_to_do()
            self.commit(self.preflight())
            self.train_loop()
            summary = self.summary()
        finally:
            for part in (self.preemption, self.checkpointer, self.metrics):  # signal handlers, writer, log
                if part is not None:
                    part.close()
            # a URL --out: the last checkpoint and the run files uploaded (a preempted run's too)
            unmirrored = self.checkpointer.close_mirror(cfg.allow_local_only) if self.checkpointer else ""
            D.teardown(d)
        if unmirrored:
            raise TrainError(unmirrored)
        return summary

    def say(self, *a, **k) -> None:
        if self.ctx.dist.is_main:  # rank 0 alone prints
            print(*a, **k)

    def setup(self) -> None:
        """Data, model config, run folder, resume source, model (+ wrap, compile), optimizer, the resume: all read
        and checked, nothing written. Components built whole, in dependency order (section, context, parts)."""
        cfg, ctx, recipe = self.cfg, self.ctx, self.recipe
        self.inputs = RunInputs(cfg, ctx, data_factory=recipe.data_factory)
        mirror = self.inputs.open_mirror()
        torch.manual_seed(cfg.seed)
        self.metrics = MetricsLogger(sections.MetricsSection.of(cfg), ctx)
        self.data, model_cfg = self.inputs.read_data(check=self.metrics.check_tracker)
        self.folder = RunFolder(ctx, force=recipe.force)
        self.early = EarlyStopping(cfg.early_stop_patience, ctx)
        # the loop's batches: each drawn one ahead, its copy to the device started while the step before computes
        self.batches = Prefetcher(self.data.train, lambda b: to_device(b, ctx.device))
        parts = (("data", self.batches, "data position"), (None, self.metrics, "token count"),
                 (None, self.early, "early-stop state"))  # what each checkpoint's state.json holds
        self.checkpointer = self.checkpointer_class(sections.CheckpointSection.of(cfg), ctx, parts=parts,
                                                    keep=self.early.keep, mirror=mirror)  # uploads once committed
        latest = self.check_run_dir(model_cfg)
        if self.early.prior is not None:
            return
        with torch.device("cpu"):
            model = recipe.model_class(model_cfg)
        if latest is None:
            self.inputs.init_weights(model, self.data, self.checkpointer)
        views = build_views(model, step := sections.StepSection.of(cfg), ctx.dist, ctx.device, self.new_optimizer)
        self.train_step = TrainStep(views, step, ctx.dist, recipe.lr_schedule, on_first_update=self.checkpointer.reserve)
        self.validator = Validator(sections.ValidationSection.of(cfg), ctx, self.data, views)
        self.say(self.metrics.banner(model_cfg, self.train_step, views))
        if latest is not None:
            self.step = self.checkpointer.resume(latest, views)

    def check_run_dir(self, model_cfg: ModelConfig) -> Path | None:
        """RUN_DIR against this run (reading only): the checkpoint to resume from, or None. Under torchrun
        every rank must see the same checkpoint (step and sha256 of its state.json), or every rank stops
        with one line (distributed.agree_on_view); never a hang, never rank 0 resuming alone."""
        def read() -> Path | None:
            self.folder.check(model_cfg)
            if self.folder.start_over:  # its checkpoints and log are removed by commit(), once all is checked
                return None
            total = total_steps(sections.StepSection.of(self.cfg), self.ctx.dist)
            latest = self.checkpointer.find_latest(self.data.tokenizer.sha256, total)
            if latest is not None:
                self.early.check_prior(latest)
            return latest

        self.checkpointer.pull_remote(model_cfg, self.recipe.force)  # a URL --out: its newest checkpoint
        latest = agreed(self.ctx.dist, self.ctx.device, f"reading the run folder {self.folder.out}", read)
        mine = D.RunView(ckpt.step_of(latest) if latest is not None else -1, Checkpointer.fingerprint(latest),
                         self.folder.start_over, self.early.prior is not None)
        D.agree_on_view(self.ctx.dist, mine, self.ctx.device, f"--out {self.folder.out}")
        return latest

    @property
    def views(self) -> ModelViews:  # the model, its wrapped and compiled forms, the optimizer (TrainStep's)
        return self.train_step.views

    def new_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        """The training optimizer, and the one the overfit gate builds for its copy of the model."""
        return optim.make_optimizer(module, self.cfg, self.ctx.device)

    def preflight(self) -> GateReport | None:
        """The pre-flight gates (training.loop.preflight_runner): before a fresh run's first step, and again on a
        resume that changed what they judged (device, dtype, world size, compile, wrapping); None: neither."""
        preflight = Preflight(self.cfg, self.ctx, self.folder, registry=self.gate_registry)
        gate_args = (self.views, self.data, self.new_optimizer, self.metrics.peak_flops)
        if not self.step:
            report = preflight.run(*gate_args)
            report.results[:0] = self.inputs.gates  # --init-from's parity gate (passed in setup)
            return report
        if changed := preflight.changed_since(self.folder.out, self.views):
            return preflight.rerun(self.folder.out, *gate_args, self.step, changed)
        return None

    def commit(self, gate_report: GateReport | None) -> None:
        self.folder.commit(model_cfg=self.views.model.cfg, train=self.cfg.to_dict(), tokenizer=self.data.tokenizer,
                           gate_report=gate_report)
        self.metrics.open(self.step)
        self.checkpointer.start_mirror()
        self.ctx.dist.barrier()

    def train_loop(self) -> None:
        cfg, start, total = self.cfg, self.step, self.train_step.total_steps
        self.start_loop()
        while self.step < total:
            if signum := self.preemption.should_stop():  # the same answer on every rank, at the same step
                self.reads.flush(self.step)  # every step's record in log.jsonl before its checkpoint
                self.preemption.stop(self.step, signum, self.save)
            self.reads.write_current(self.reads.current)  # the step before's, when no read completed it
            self.step += 1
            self.one_step()
            last, stopping = self.step == total, bool(cfg.stop_at and self.step >= cfg.stop_at)
            evaluate = self.validator.should_validate(self.step, last=last)
            if not (evaluate or stopping or last or self.step == start + 1 or self.step % cfg.log_every == 0
                    or (cfg.save_every and self.step % cfg.save_every == 0)):
                continue
            rec = self.reads.read(self.step)  # one host sync for every step since the last read
            if rec is None:  # this step's update was dropped (non-finite or spike)
                continue
            new_best = evaluate and self.evaluate(rec)
            self.reads.write_current(rec)
            if self.metrics.should_print(self.step, first=self.step == start + 1, last=last):
                self.say(self.metrics.progress_line(rec, self.step, total, self.validator.last))
            if evaluate and self.early.should_stop():
                self.checkpointer.finish()  # the write in flight must land before the checkpoints after the best go
                self.early.stop(self.step)
                return
            if self.checkpointer.should_save(self.step, last=last, stopping=stopping,
                                             new_best=bool(new_best and self.early.patience)):
                self.save()
            if stopping:
                self.say(f"stopping at step {self.step} (--stop-at); run the same command without it to continue")
                break
        self.reads.flush(self.step)
        if self.step > self.checkpointer.saved_step:  # the last step's batch was dropped: still end on a checkpoint
            self.save()

    def start_loop(self) -> None:
        """The clock, the signal handlers, and the deferred reads with their checks."""
        self.metrics.start(self.views.model.cfg)
        self.preemption = PreemptionStop(self.ctx, self.checkpointer)
        self.preemption.install()
        checks = RuntimeChecks(section := sections.ChecksSection.of(self.cfg), self.ctx, self.views.trainable)
        self.reads = StepReads(section, deferred=self.train_step.deferrable, judge=checks.judge,
                               record=MetricsLogger.record, write=self.metrics.write)

    def one_step(self) -> None:
        """Compute the step; apply its update now when a check must read it first, else on the device."""
        read_now = self.reads.should_read_now(self.step)
        r = self.train_step.compute(self.step, self.batches, read_now=read_now)
        r.fields = self.metrics.count(self.train_step.tokens_per_step)  # a dropped batch's tokens still count
        self.reads.add(r)
        if read_now:
            self.reads.read(self.step)
            self.train_step.apply(r)
        else:
            self.train_step.apply_deferred(r)

    def evaluate(self, rec: dict) -> bool:
        """Validation merged into the step's record; True on a new best validation loss."""
        val = self.validator.validate()
        rec.update(val)
        return self.early.track(self.step, val["val_loss"])

    def save(self) -> None:
        self.checkpointer.save(self.step, self.views, self.data.tokenizer)

    def summary(self) -> dict:
        self.checkpointer.finish()  # "done" only once the last checkpoint is on disk
        self.preemption.restore()
        out = self.metrics.summary(self.step)
        self.say(f"done: {self.step} steps, {out['tokens']:,} tokens in {fmt_duration(out['elapsed_s'])}; "
                 f"run folder {self.folder.out}")
        return {**out, **(self.validator.last or {}), **self.early.summary(), **self.checkpointer.timings()}

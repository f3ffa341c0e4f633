"""EarlyStopping (--early-stop-patience N): after N evaluations without a new best validation loss the
run stops; every new best is checkpointed (and never pruned), the checkpoints after it are removed,
so the newest checkpoint, the one export and serving take, is the best one. RUN_DIR/early_stop.json
and a log.jsonl event record the decision; running the same command again then has nothing to do.
The best so far is in every checkpoint's state.json ("early_stop"), for an exact resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

from training.checkpoint import checkpoint_io as ckpt
from training.run_context import RunContext
from training.runfiles import layout


class EarlyStopping:
    def __init__(self, patience: int, ctx: RunContext):
        self.patience, self.out, self.dist, self.log, self.say = patience, ctx.out, ctx.dist, ctx.log, ctx.say
        self.best: dict = {"val_loss": None, "step": 0, "evals_since": 0}
        self.stopped: dict | None = None  # this session's early_stop record
        self.prior: dict | None = None  # early_stop.json of an earlier session this command repeats

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"early_stop": dict(self.best)}

    def load_state_dict(self, state: dict) -> None:
        best = state.get("early_stop")  # absent in checkpoints of runs that predate early stopping
        if isinstance(best, dict) and set(best) == set(self.best):
            self.best = dict(best)

    def keep(self) -> set[int]:
        """The checkpoint keep-N must not prune: the best one, while early stopping is on."""
        return {self.best["step"]} if self.patience else set()

    # ---------------------------------------------------------------------------------- cadence
    def track(self, step: int, val_loss: float) -> bool:
        """Update the best validation loss so far; True when `val_loss` is a new best."""
        b = self.best
        if b["val_loss"] is None or val_loss < b["val_loss"]:
            b.update(val_loss=val_loss, step=step, evals_since=0)
            return True
        b["evals_since"] += 1
        return False

    def should_stop(self) -> bool:
        return bool(self.patience and self.best["evals_since"] >= self.patience)

    def check_prior(self, latest: Path) -> None:
        """`prior`: RUN_DIR/early_stop.json of an earlier session that this command would repeat, so there
        is nothing to do (from the best checkpoint, a patience no larger than the one that stopped stops
        there again)."""
        if not (self.patience and (self.out / layout.EARLY_STOP).is_file()):
            return
        rec = layout.read_json(self.out / layout.EARLY_STOP, "early-stop record",
                               required={"step": int, "best_step": int, "patience": int})
        if ckpt.step_of(latest) == rec["best_step"] and self.patience <= rec["patience"]:
            self.prior = rec

    # ------------------------------------------------------------------------------------- stop
    def stop(self, step: int) -> dict:
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
        rec = {"event": "early_stop", "step": step, "best_step": b["step"], "best_val_loss": b["val_loss"],
               "patience": self.patience, "best_checkpoint": best_ckpt.name if kept else None,
               "removed_checkpoints": removed}
        if d.is_main:
            tmp = self.out / (layout.EARLY_STOP + ".tmp")
            tmp.write_text(json.dumps(rec, indent=2) + "\n")
            os.replace(tmp, self.out / layout.EARLY_STOP)
            self.log(rec)
        d.barrier()
        self.stopped = rec
        where = (f"checkpoint {best_ckpt.name} is now the newest" if kept else
                 "no checkpoint of that step exists (early stopping was switched on later); the newest is kept")
        self.say(f"early stop at step {step}: no better validation loss in {self.patience} evaluations; best "
                 f"{b['val_loss']:.4f} at step {b['step']}; {where}")
        return rec

    def nothing_to_do(self) -> dict:
        """The summary of a command whose run already stopped early (`prior`)."""
        rec = self.prior or {}
        self.say(f"{self.out} already stopped early at step {rec['step']} (best validation at step "
                 f"{rec['best_step']}, its newest checkpoint) with patience {rec['patience']}; nothing to do. To "
                 "train on from there, run with --early-stop-patience 0 or a larger patience")
        return {"step": rec["best_step"], "run_dir": str(self.out), "early_stop": rec}

    def summary(self) -> dict:
        out = {}
        if self.best["val_loss"] is not None:
            out["best_val_loss"], out["best_step"] = self.best["val_loss"], self.best["step"]
        if self.stopped is not None:
            out["early_stop"] = self.stopped
        return out

"""RunFolder: is --out a folder this run may use, and writing it once everything is checked.

"Ours" is decided from layout.RUN_MARKER, the first file prodip writes into a run folder, never from
file names a user's folder may hold too (their own log.jsonl or tokenizer.model): a folder without
the marker, run.json or checkpoints/ that holds anything is refused unless --force. `check()` only
reads; `commit()` writes, rank 0 alone: the marker, the tokenizer, gates.json, then run.json
atomically (a kill mid-commit leaves a folder the marker still names as ours).
"""

from __future__ import annotations

import json
import os
import shutil

from training import gates
from training.loop.rank_agreement import TrainError
from training.model.decoder import ModelConfig
from training.run_context import RunContext
from training.runfiles import layout
from training.text.tokenizer import Tokenizer

# named last in the refusal: a user's folder is described by the file a user would recognize
_OUR_NAMES = frozenset({layout.GATES, layout.LOG, layout.TOKENIZER, layout.NONFINITE, layout.EARLY_STOP})


class RunFolder:
    def __init__(self, ctx: RunContext, *, force: bool):
        self.out, self.dist, self.kind, self.force = ctx.out, ctx.dist, ctx.kind, force
        self.holds_run = False  # run.json or checkpoints/: a failed gate report must not go there
        self.start_over = False  # --force over a run with another model config: commit() clears it

    def check(self, model_cfg: ModelConfig) -> None:
        """This rank's reading of --out (nothing is written): TrainError when it is not usable."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise TrainError(f"--out {out} is a file, not a run folder; use another --out")
        try:
            old = layout.read_run_config(out)
        except layout.LayoutError as e:
            raise TrainError(f"unreadable run folder: {e}; use another --out or --force") from None
        has_checkpoints = (out / layout.CHECKPOINTS).exists()
        self.holds_run = old is not None or has_checkpoints
        if old is not None and old.get("model") != model_cfg.to_dict():
            if not self.force:
                was = old.get("model") or {}
                diff = {k: (was.get(k), v) for k, v in model_cfg.to_dict().items() if was.get(k) != v}
                raise TrainError(f"{out} holds a run with another model config {diff} (old, new); "
                                 "use another --out, or --force to start over there")
            self.start_over = True
        if self.holds_run or self.force or not out.is_dir() or (out / layout.RUN_MARKER).exists():
            return
        # the lock file is this run's own (training.loop.run_lock, taken before this check): not the user's
        foreign = sorted((p.name for p in out.iterdir() if p.name != layout.RUN_LOCK),
                         key=lambda n: (n in _OUR_NAMES, n))
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise TrainError(f"{out} exists and is not a prodip run folder (it holds {foreign[0]!r}{more}); "
                             "use another --out or --force")

    def mark(self) -> None:
        """The folder, and the marker that makes it ours, before anything else is written into it."""
        self.out.mkdir(parents=True, exist_ok=True)
        marker = self.out / layout.RUN_MARKER
        if not marker.exists():
            marker.write_text("a prodip run folder (training.loop.run_folder)\n", encoding="utf-8")

    def save_failed_gates(self, report: gates.GateReport) -> None:
        """A failed pre-flight report is the user's to read; a folder holding a run keeps its own gates.json."""
        if self.dist.is_main and not self.holds_run:
            self.mark()
            report.save(self.out / layout.GATES)

    def commit(self, *, model_cfg: ModelConfig, train: dict, tokenizer: Tokenizer,
               gate_report: gates.GateReport | None = None) -> None:
        """Write the run folder, now that everything is checked (rank 0; every rank waits for it to start):
        with the passed pre-flight report (None: a resume the gates need not judge again). With --force
        over another run, its checkpoints and log go first."""
        d = self.dist
        d.barrier()  # every rank has read the run folder before rank 0 writes into it
        if not d.is_main:
            return
        self.mark()
        if self.start_over:
            shutil.rmtree(self.out / layout.CHECKPOINTS, ignore_errors=True)
            (self.out / layout.LOG).unlink(missing_ok=True)
        (self.out / layout.EARLY_STOP).unlink(missing_ok=True)  # training on: an old early stop no longer holds
        if gate_report is not None:
            gate_report.save(self.out / layout.GATES)
        tokenizer.save(self.out / layout.TOKENIZER)
        key, version = layout.RUN_FORMAT
        run_cfg = {key: version, "kind": self.kind, "model": model_cfg.to_dict(), "train": train}
        tmp = self.out / (layout.RUN_CONFIG + ".tmp")  # a kill mid-write must not leave an unreadable run.json
        tmp.write_text(json.dumps(run_cfg, indent=2, ensure_ascii=False))
        os.replace(tmp, layout.run_config_path(self.out))

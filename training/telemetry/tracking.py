"""Optional live logging of the step records (`--log-to tensorboard`): files under the run folder,
no account, no server. `tensorboard --logdir RUN/tensorboard` shows them while the run goes on.

Needs the `tensorboard` package (pip install tensorboard); torch ships the writer. Each record's
numbers are logged at its step: `train/loss`, `train/lr`, ..., `val/val_loss`, `val/val_bpb`, and an
event record's under `event/<event>/<key>`. A resumed run purges what the earlier segment logged past
its first step, so the curves continue exactly as log.jsonl does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from training.runfiles.schema import unknown_name

TRACKERS = ("tensorboard",)
LOG_TO = ("", *TRACKERS)  # "" (the default) = log.jsonl and curves.png only
TENSORBOARD_DIR = "tensorboard"  # under the run folder
FLUSH_SECS = 10  # how stale a live view may be (the writer's default is 120 s)
INSTALL_HINT = "pip install tensorboard"


def tag(record: Mapping, key: str) -> str:
    if "event" in record:
        return f"event/{record['event']}/{key}"
    return f"val/{key}" if key.startswith("val_") else f"train/{key}"


def numbers(record: Mapping) -> dict[str, float]:
    """The record's finite numbers, bools and the step itself excepted."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)}


class TensorBoardTracker:
    """A torch.utils.tensorboard SummaryWriter, opened at the first record (its step purges what an
    earlier, longer segment of a resumed run wrote past that point)."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch raises ImportError naming tensorboard when the package is missing
            raise ValueError(f"--log-to tensorboard needs the tensorboard package: {INSTALL_HINT}") from None
        self._writer_class = SummaryWriter
        self.log_dir = Path(log_dir)
        self.writer = None

    def log(self, record: Mapping) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        if self.writer is None:
            self.writer = self._writer_class(log_dir=str(self.log_dir), purge_step=step, flush_secs=FLUSH_SECS)
        for key, v in numbers(record).items():
            self.writer.add_scalar(tag(record, key), v, global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def open_tracker(log_to: str, run_dir: Path) -> TensorBoardTracker | None:
    """The tracker `log_to` names, or None for ""; an unknown name or a missing package is a ValueError."""
    if log_to not in LOG_TO:
        raise unknown_name("--log-to value", log_to, TRACKERS)
    if log_to == "tensorboard":
        return TensorBoardTracker(Path(run_dir) / TENSORBOARD_DIR)
    return None

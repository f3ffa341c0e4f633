"""RunContext: what every component of one training run shares, built once by the Trainer.

The process group (training.distributed.Dist), the device, the local run folder (a URL --out's local
cache), the run's kind (pretrain, sft), where event records go (log.jsonl, training.telemetry.
metrics_logger.EventLog) and how a line is said (rank 0 alone prints). Frozen: a component reads it,
and nothing changes it under another component.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from training import distributed as D


def _no_events(rec: dict) -> None:
    """A context without a log (a component built alone, in a test or a script): events are dropped."""


@dataclass(frozen=True)
class RunContext:
    dist: D.Dist = field(default_factory=D.Dist)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    out: Path = Path(".")
    kind: str = "pretrain"
    log: Callable[[dict], None] = _no_events  # an event record into log.jsonl (queued until it opens)
    say: Callable[[str], None] = print  # a line for the user: the Trainer's prints on rank 0 only

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))  # a str --out from a test or a script

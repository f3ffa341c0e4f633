"""The flags of `--executor local|slurm|ray --tasks N` (training.prepare.cluster.executors runs them) and their
validation, before anything is planned or written: Slurm's own formats for --partition and --time,
whole numbers for --cpus-per-task and --mem-per-cpu (sbatch takes --mem-per-cpu=NG)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from training.prepare.errors import PrepareError
from training.runfiles.schema import PositiveInt, flag

EXECUTORS = ("local", "slurm", "ray")
CLUSTER_FLAGS = ("executor", "tasks", "work", "partition", "time", "cpus_per_task", "mem_per_cpu", "ray_address")
SLURM_FLAGS = {"partition": "--partition", "time": "--time", "cpus_per_task": "--cpus-per-task",
               "mem_per_cpu": "--mem-per-cpu"}
# sbatch --time (man sbatch): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; or no limit
SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|INFINITE|UNLIMITED", re.IGNORECASE)
SLURM_PARTITION = re.compile(r"[A-Za-z0-9][\w.-]*(,[A-Za-z0-9][\w.-]*)*")  # one name, or several with commas


@dataclass
class ClusterOptions:
    executor: str
    tasks: int = 1
    work: Path | None = None
    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    mem_per_cpu: int | None = None  # GB
    ray_address: str | None = None

    def validate(self) -> None:
        if self.executor not in EXECUTORS:
            raise PrepareError(f"--executor {self.executor!r}: one of {', '.join(EXECUTORS)}")
        if self.tasks < 1:
            raise PrepareError(f"--tasks must be at least 1, got {self.tasks}")
        given = [f for k, f in SLURM_FLAGS.items() if getattr(self, k) is not None]
        if self.executor == "local" and given:
            raise PrepareError(f"{given[0]} is a cluster option: use it with --executor slurm or ray")
        if self.executor != "ray" and self.ray_address is not None:
            raise PrepareError("--ray-address goes with --executor ray")
        if self.executor == "ray" and (self.partition or self.time):
            raise PrepareError(f"{'--partition' if self.partition else '--time'} is a Slurm option: use it "
                               f"with --executor slurm")
        if self.executor == "slurm":
            if not self.partition or not self.time:
                raise PrepareError("--executor slurm needs --partition NAME and --time LIMIT (e.g. --time 4:00:00)")
            if not SLURM_PARTITION.fullmatch(self.partition):
                raise PrepareError(f"--partition {self.partition!r}: not a Slurm partition name (letters, digits, "
                                   f"_ . -; several separated by commas)")
            if not SLURM_TIME.fullmatch(self.time):
                raise PrepareError(f"--time {self.time!r}: Slurm takes MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                                   f"D-HH:MM:SS or UNLIMITED")


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("across machines (pip install 'prodip[cluster]'; docs/data.md)")
    g.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="run the prepare as --tasks datatrove tasks: on this machine, as Slurm jobs, or on a "
                        "running Ray cluster (needs --tokenizer); the output equals one process's")
    g.add_argument("--tasks", type=flag(PositiveInt), default=None, metavar="N",
                   help="tasks for the scan and encode stages (input files are split between them)")
    g.add_argument("--work", type=Path, default=None, metavar="DIR",
                   help="the tasks' folder, on storage every node sees (default: DATA_DIR.work)")
    g.add_argument("--partition", default=None, help="Slurm partition")
    g.add_argument("--time", default=None, metavar="LIMIT", help="Slurm time limit per job, e.g. 4:00:00")
    g.add_argument("--cpus-per-task", type=flag(PositiveInt), default=None, metavar="N",
                   help="Slurm/Ray CPUs per task (and prodip workers in it)")
    g.add_argument("--mem-per-cpu", type=flag(PositiveInt), default=None, metavar="GB", help="Slurm/Ray memory per CPU")
    g.add_argument("--ray-address", default=None, metavar="ADDR", help="Ray cluster to join (default: auto)")


def add_task_parser(sub) -> None:
    t = sub.add_parser("task", help="run one task of an --executor slurm run (what its jobs run)",
                       description="Inside a Slurm job that --executor slurm submitted: run this array index's "
                                   "task of STAGE.")
    t.add_argument("stage", choices=("scan", "dedup", "encode", "merge"))
    t.add_argument("--work", type=Path, required=True, metavar="DIR")
    t.add_argument("--workers", type=flag(PositiveInt), default=None, metavar="N")
    t.add_argument("--force", action="store_true", help="the merge replaces an existing DATA_DIR")
    t.add_argument("--debug", action="store_true", help="show tracebacks")


def cluster_options(args: argparse.Namespace) -> ClusterOptions | None:
    """The --executor flags as ClusterOptions, or None for a one-process run (then none may be given)."""
    x = {k: getattr(args, k) for k in CLUSTER_FLAGS}
    if x["executor"] is None:
        given = [k for k, v in x.items() if v is not None]
        if given:
            raise PrepareError(f"--{given[0].replace('_', '-')} goes with --executor local|slurm|ray")
        return None
    x["tasks"] = 1 if x["tasks"] is None else x["tasks"]
    return ClusterOptions(**x)

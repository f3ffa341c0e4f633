"""The task plan of `--executor ... --tasks N`: which input files each task reads, the options, the
tokenizer, written once to WORK/plan.json, and the checks every stage runs on WORK before it reads.

Tasks take contiguous runs of input files (balanced by file size), so the tasks' documents, read in
task order, are the one-machine run's documents in its order: that is what lets the merge write
the same bytes. A file is never split: a corpus of fewer files than --tasks leaves tasks idle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np

from training.prepare.errors import PrepareError
from training.prepare.options import Options
from training.prepare.sources import resolve_sources
from training.runfiles import layout
from training.runfiles.schema import HF_PREFIX

PLAN = "plan.json"
PLAN_FORMAT = 1
TOKENIZER = "tokenizer.model"
STAGES = ("scan", "dedup", "encode", "merge")
ONE_TASK = ("dedup", "merge")  # one task each; scan and encode run --tasks tasks
PATH_OPTIONS = ("tokenizer", "extend_tokenizer", "quality")


NOT_PLANNED = ("force", "progress", "echo")  # how this command runs, not what the tasks write


def options_json(opt: Options) -> dict:
    d = {k: v for k, v in dataclasses.asdict(opt).items() if k not in NOT_PLANNED}
    for k in PATH_OPTIONS:
        d[k] = None if d[k] is None else str(Path(d[k]).resolve())
    d["decontaminate"] = [str(Path(p).resolve()) for p in opt.decontaminate]
    d["balance_range"] = list(opt.balance_range)
    return d


def options_from(plan: dict, workers: int | None = None, *, echo: bool = False) -> Options:
    """The run's Options, as a task sees them (its own worker count, no bars, no tables)."""
    d = dict(plan["options"])
    for k in PATH_OPTIONS:
        d[k] = None if d[k] is None else Path(d[k])
    d["decontaminate"] = [Path(p) for p in d["decontaminate"]]
    d["balance_range"] = tuple(d["balance_range"])
    opt = Options(**d)
    opt.progress, opt.echo = False, echo
    if workers is not None:
        opt.workers = workers
    return opt


def _weight(name: str) -> int:
    return 1 << 20 if name.startswith(HF_PREFIX) else max(os.path.getsize(name), 1)


def partition(names: list[str], tasks: int) -> list[list[str]]:
    """Contiguous runs of `names`, one per task, of about equal size (a file is never split)."""
    cum = np.cumsum([_weight(n) for n in names], dtype=np.float64)
    total = float(cum[-1]) if len(cum) else 0.0
    # task k ends after the first file whose running size reaches k/tasks of the total
    ends = [int(np.searchsorted(cum, total * k / tasks, side="left")) + 1 for k in range(1, tasks)]
    bounds = [0, *(min(e, len(names)) for e in ends), len(names)]
    return [names[bounds[k]:bounds[k + 1]] for k in range(tasks)]


def make_plan(inputs: list, opt: Options, tasks: int, out: Path) -> dict:
    """The plan for `tasks` tasks; resolves (and so checks) every input first."""
    sources = resolve_sources(inputs)
    names = [s.name if s.name.startswith(HF_PREFIX) else str(Path(s.name).resolve()) for s in sources]
    assert opt.tokenizer is not None
    plan = {"prodip_task_plan": PLAN_FORMAT, "tasks": tasks, "out": str(Path(out).resolve()),
            "inputs": [str(p) if str(p).startswith(HF_PREFIX) else str(Path(p).resolve()) for p in inputs],
            "options": options_json(opt), "tokenizer_sha256": hashlib.sha256(opt.tokenizer.read_bytes()).hexdigest(),
            "sources": partition(names, tasks)}
    plan["run"] = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    return plan


def check_work(work: Path, plan: dict) -> None:
    """A WORK folder is this run's (a rerun finishes it) or new; another run's is refused."""
    if work.exists() and not work.is_dir():
        raise PrepareError(f"--work {work} exists and is not a folder")
    if (work / PLAN).is_file():
        old = json.loads((work / PLAN).read_text(encoding="utf-8"))
        if old.get("run") != plan["run"]:
            raise PrepareError(f"--work {work} holds the tasks of another run (other inputs, options, tokenizer "
                               f"or --tasks); delete it or pass another --work")
    elif work.exists() and any(work.iterdir()):
        raise PrepareError(f"--work {work} exists and holds no task plan; give an empty or new folder")


def write_plan(work: Path, plan: dict, tokenizer: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    if not (work / PLAN).is_file():
        shutil.copy2(tokenizer, work / TOKENIZER)
        tmp = work / f".{PLAN}.tmp"
        tmp.write_text(json.dumps(plan, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, work / PLAN)


def read_plan(work: Path) -> dict:
    try:
        plan = layout.read_json(Path(work) / PLAN, "task plan")
    except layout.LayoutError as e:
        raise PrepareError(str(e)) from None
    if plan.get("prodip_task_plan") != PLAN_FORMAT:
        raise PrepareError(f"{work}/{PLAN}: task plan format {plan.get('prodip_task_plan')}, this prodip "
                           f"reads {PLAN_FORMAT}")
    sha = hashlib.sha256((Path(work) / TOKENIZER).read_bytes()).hexdigest() if (Path(work) / TOKENIZER).is_file() else None
    if sha != plan["tokenizer_sha256"]:
        raise PrepareError(f"{work}/{TOKENIZER} is not the tokenizer the plan names "
                           f"({str(sha)[:12]}…, plan {plan['tokenizer_sha256'][:12]}…)")
    return plan


def task_dir(work: Path, stage: str, rank: int) -> Path:
    return Path(work) / stage / f"{rank:05d}"


def logs_dir(work: Path, stage: str) -> Path:
    return Path(work) / "logs" / stage


def finished(work: Path, stage: str, rank: int) -> bool:
    """datatrove's completion marker: written only after the task returned."""
    return (logs_dir(work, stage) / "completions" / f"{rank:05d}").is_file()


def check_finished(work: Path, plan: dict, stage: str, what: str) -> None:
    """Every task of `stage` finished and wrote this plan's tokenizer, or one line naming the first that
    did not (nothing is read or written before this passes)."""
    for rank in range(1 if stage in ONE_TASK else plan["tasks"]):
        folder = task_dir(work, stage, rank)
        if not finished(work, stage, rank) or not (folder / "task.json").is_file():
            raise PrepareError(f"{what}: task {rank} of {stage} did not finish (no {logs_dir(work, stage)}/"
                               f"completions/{rank:05d}); rerun the same command to run only unfinished tasks")
        head = json.loads((folder / "task.json").read_text(encoding="utf-8"))
        if head.get("tokenizer_sha256") != plan["tokenizer_sha256"] or head.get("run") != plan["run"]:
            raise PrepareError(f"{what}: {folder} was written with another tokenizer or run (tokenizer sha256 "
                               f"{str(head.get('tokenizer_sha256'))[:12]}…, this plan's "
                               f"{plan['tokenizer_sha256'][:12]}…); refused")


class Clock:
    """A task's wall and CPU seconds (its own and its finished worker processes'), for task.json: the
    per-task throughput docs/data.md projects from."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), self._cpu()

    @staticmethod
    def _cpu() -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime

    def seconds(self) -> dict:
        return {"wall": round(time.perf_counter() - self.wall, 3), "cpu": round(self._cpu() - self.cpu, 3)}


def write_task(folder: Path, plan: dict, body: dict, clock: Clock | None = None) -> None:
    """task.json last: a folder without it is a task that did not finish."""
    head = {"run": plan["run"], "tokenizer_sha256": plan["tokenizer_sha256"], **body,
            **({"seconds": clock.seconds()} if clock is not None else {})}
    (folder / "task.json").write_text(json.dumps(head, ensure_ascii=False) + "\n", encoding="utf-8")


def fresh(folder: Path) -> Path:
    """An empty task folder (a failed try's leftovers removed): a rerun writes it whole."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder

"""`python -m training.prepare ... --executor local|slurm|ray --tasks N`: the prepare as datatrove
tasks (pip install 'prodip[cluster]'), in four stages, each waiting for the one before:

    scan (N tasks) -> dedup (1) -> encode (N tasks) -> merge (1)     (training.prepare.cluster.cluster_tasks,
                                                                      training.prepare.cluster.cluster_merge)

local   datatrove's LocalPipelineExecutor on this machine, stage after stage.
slurm   one sbatch job per stage (scan and encode as array jobs), each `--dependency=afterok` on the
        one before; the jobs run `python -m training.prepare task STAGE --work WORK` (no pickled
        executor is ever loaded: the pickle datatrove writes is deleted once submitted).
ray     datatrove's RayPipelineExecutor on a running Ray cluster (pip install 'prodip[cluster-ray]').

Every task marks its completion (datatrove's WORK/logs/STAGE/completions/RANK); the same command run
again runs only the tasks without one. datatrove is imported only here, only when --executor is given.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

from training.prepare.cluster import cluster_slurm
from training.prepare.cluster.cluster_merge import merge_tasks
from training.prepare.cluster.cluster_plan import (
    ONE_TASK,
    STAGES,
    check_work,
    finished,
    logs_dir,
    make_plan,
    read_plan,
    write_plan,
)
from training.prepare.cluster.cluster_tasks import dedup, encode, scan
from training.prepare.cluster.executor_flags import ClusterOptions
from training.prepare.errors import PrepareError
from training.prepare.pipeline import _check_out, _options

INSTALL = {"local": "pip install 'prodip[cluster]'", "slurm": "pip install 'prodip[cluster]'",
           "ray": "pip install 'prodip[cluster-ray]'"}
DEFAULT_MEM_PER_CPU_GB = cluster_slurm.DEFAULT_MEM_PER_CPU_GB


def require(executor: str):
    """datatrove's executor module for `executor`, or one line saying what to install."""
    try:
        mod = importlib.import_module(f"datatrove.executor.{executor}")
        if executor == "ray":
            importlib.import_module("ray")
    except ImportError as e:
        pkg = (e.name or "datatrove").split(".")[0]
        raise PrepareError(f"--executor {executor} needs {pkg}, which is not installed: {INSTALL[executor]}") from None
    return mod


class Step:
    """One stage as a datatrove pipeline step: called with (data, rank, world_size) in each task."""

    def __init__(self, stage: str, work: str, workers: int | None, force: bool = False):
        self.stage, self.work, self.workers, self.force = stage, work, workers, force

    def __repr__(self) -> str:
        return f"prodip {self.stage}"

    def __call__(self, data=None, rank: int = 0, world_size: int = 1):
        work = Path(self.work)
        if self.stage == "merge":
            merge_tasks(work, Path(read_plan(work)["out"]), force=self.force)
        else:
            {"scan": scan, "dedup": dedup, "encode": encode}[self.stage](work, rank, self.workers)
        return data


def _stage_tasks(stage: str, tasks: int) -> int:
    return 1 if stage in ONE_TASK else tasks


def incomplete(work: Path, stage: str, tasks: int) -> list[int]:
    return [r for r in range(_stage_tasks(stage, tasks)) if not finished(work, stage, r)]


def run_cluster(inputs: list, out: Path, options: dict, x: ClusterOptions) -> dict | None:
    """Plan, then run (local, ray) or submit (slurm) the four stages. Returns meta.json's content when
    the merge ran here; None when Slurm will run it. Raises PrepareError before writing on bad input."""
    x.validate()
    opt = _options(options)
    out = Path(out)
    if opt.tokenizer is None:
        raise PrepareError("--executor needs --tokenizer FILE: every task must encode with the same tokenizer "
                           "(train it first with one ordinary prepare run)")
    if opt.num_shards > 1:
        raise PrepareError("--executor makes its own tasks: drop --shard-index/--num-shards")
    plan = make_plan(inputs, opt, x.tasks, out)  # every input resolved (a missing one named) first
    require(x.executor)
    if x.executor == "slurm" and shutil.which("sbatch") is None:
        raise PrepareError("--executor slurm: sbatch not found on PATH; run this on a Slurm login node")
    if x.executor == "ray":  # a cluster that is not there is refused before anything is written
        import ray

        if not ray.is_initialized():
            ray.init(address=x.ray_address or "auto")
    work = Path(x.work) if x.work is not None else out.with_name(out.name + ".work")
    check_work(work, plan)
    _check_out(out, opt.force)
    write_plan(work, plan, opt.tokenizer)
    if opt.force:  # the merge runs again and replaces DATA_DIR; finished tasks are kept
        (logs_dir(work, "merge") / "completions" / f"{0:05d}").unlink(missing_ok=True)
    if x.executor == "slurm":
        steps = [(s, _stage_tasks(s, x.tasks), Step(s, str(work), x.cpus_per_task, opt.force)) for s in STAGES]
        ids = cluster_slurm.submit(steps, work, x, opt.force)
        print(submitted_line(ids, x.tasks, out, work))
        return None
    for stage in STAGES:
        _run_stage(work, stage, x, opt.workers, opt.force)
    return read_meta(out)


def submitted_line(ids: dict, tasks: int, out: Path, work: Path) -> str:
    jobs = ", ".join(f"{s} {'(finished)' if ids[s] == -1 else ids[s]}" + (f" ({tasks} tasks)" if s not in ONE_TASK else "")
                     for s in STAGES)
    return (f"submitted Slurm jobs: {jobs}, each after the one before; {out} appears when merge ends (logs in "
            f"{work}/logs); if a task fails, run the same command again: only unfinished tasks are submitted")


def run_task(stage: str, work: Path, workers: int | None, force: bool) -> None:
    """`python -m training.prepare task STAGE --work WORK`: inside a job --executor slurm submitted,
    run this array index's task of STAGE (datatrove marks it complete)."""
    require("slurm")
    if not cluster_slurm.in_job():
        raise PrepareError("task: runs inside the Slurm jobs --executor slurm submits (no SLURM_ARRAY_TASK_ID); "
                           "to finish a run here, run the prepare command again with --executor local")
    if stage not in STAGES:
        raise PrepareError(f"task: stage {stage!r}: one of {', '.join(STAGES)}")
    plan = read_plan(work)
    x = ClusterOptions("slurm", plan["tasks"], work, partition="-", time="0", cpus_per_task=workers)
    cluster_slurm.executor(stage, work, _stage_tasks(stage, plan["tasks"]), x, Step(stage, str(work), workers, force),
                           force).run()


def read_meta(out: Path) -> dict:
    return json.loads((out / "meta.json").read_text(encoding="utf-8"))


def _run_stage(work: Path, stage: str, x: ClusterOptions, workers: int | None, force: bool) -> None:
    n = _stage_tasks(stage, x.tasks)
    logging_dir = str(logs_dir(work, stage))
    if x.executor == "local":
        from datatrove.executor.local import LocalPipelineExecutor

        parallel = min(n, os.cpu_count() or 1)
        if parallel > 1:  # the pool's processes fork from a server that imported prodip once, not each task
            import multiprocess

            multiprocess.get_context("forkserver").set_forkserver_preload([__name__])
        # datatrove's pool processes are daemonic and cannot start prodip's pool: one worker per task there
        step = Step(stage, str(work), 1 if parallel > 1 else workers, force)
        ex = LocalPipelineExecutor([step], tasks=n, workers=parallel, logging_dir=logging_dir, skip_completed=True)
    else:
        from datatrove.executor.ray import RayPipelineExecutor

        step = Step(stage, str(work), x.cpus_per_task or workers, force)
        ex = RayPipelineExecutor([step], tasks=n, logging_dir=logging_dir, skip_completed=True,
                                 cpus_per_task=x.cpus_per_task or 1,
                                 mem_per_cpu_gb=x.mem_per_cpu or DEFAULT_MEM_PER_CPU_GB)
    why = ""
    try:
        ex.run()
    except Exception as e:  # a task's error: the tasks without a completion marker are named below
        why = f" ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no message'})"
    if left := incomplete(work, stage, x.tasks):
        raise PrepareError(f"{stage}: task(s) {', '.join(map(str, left))} of {n} did not finish{why}; logs in "
                           f"{logging_dir}/logs; run the same command again to run only those")

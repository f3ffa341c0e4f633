"""--executor slurm: the four stages as sbatch jobs through datatrove's SlurmPipelineExecutor, each
`--dependency=afterok` on the one before, and the command each job runs on its node:

    python -m training.prepare task STAGE --work WORK [--workers C] [--force]

datatrove's own launch line loads a pickled executor; ours rebuilds the executor from WORK/plan.json
instead (prodip never unpickles), and the pickle datatrove writes at submission is deleted.
"""

from __future__ import annotations

import os
import shlex
import sys
from functools import cache
from pathlib import Path

from training.prepare.cluster.cluster_plan import logs_dir

JOB_PREFIX = "prodip-prepare-"
PICKLE = "executor.pik"
DEFAULT_MEM_PER_CPU_GB = 2


@cache
def _executor_class():
    from datatrove.executor.slurm import SlurmPipelineExecutor

    class ProdipSlurm(SlurmPipelineExecutor):
        """SlurmPipelineExecutor whose jobs run `python -m training.prepare task ...`."""

        def __init__(self, *args, command: str, **kwargs):
            super().__init__(*args, **kwargs)
            self.command = command

        def get_launch_file_contents(self, sbatch_args: dict, run_script: str) -> str:
            head, sep, _ = run_script.partition("launch_pickled_pipeline")
            return super().get_launch_file_contents(sbatch_args, head + self.command if sep else run_script)

        def launch_job(self):
            super().launch_job()
            Path(self.logging_dir.resolve_paths(PICKLE)).unlink(missing_ok=True)

    ProdipSlurm.__module__ = __name__
    return ProdipSlurm


def task_command(stage: str, work: Path, workers: int | None, force: bool) -> str:
    cmd = [sys.executable, "-m", "training.prepare", "task", stage, "--work", str(Path(work).resolve())]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    if force:
        cmd.append("--force")
    return shlex.join(cmd)


def _env_command() -> str:
    """The job's environment: this folder, and this virtual environment when there is one (datatrove's
    stats job runs its `merge_stats` script from there)."""
    env = f"cd {shlex.quote(os.getcwd())}"
    if sys.prefix != sys.base_prefix:
        env += f" && source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}"
    return env


def executor(stage: str, work: Path, n: int, x, step, force: bool, depends=None):
    """The stage's SlurmPipelineExecutor of `n` tasks running `step` (`x`: executors.ClusterOptions)."""
    return _executor_class()(
        [step], tasks=n, time=x.time, partition=x.partition, cpus_per_task=x.cpus_per_task or 1,
        mem_per_cpu_gb=x.mem_per_cpu or DEFAULT_MEM_PER_CPU_GB, job_name=JOB_PREFIX + stage, qos="",
        env_command=_env_command(), logging_dir=str(logs_dir(work, stage)), skip_completed=True, depends=depends,
        command=task_command(stage, work, x.cpus_per_task, force))


def submit(stages: list[tuple[str, int, object]], work: Path, x, force: bool) -> dict[str, object]:
    """Submit (stage, tasks, step) in order, each after the one before; return each stage's job id
    (-1: all its tasks had finished, nothing submitted)."""
    chain, made = None, []
    for stage, n, step in stages:
        chain = executor(stage, work, n, x, step, force, depends=chain)
        made.append((stage, chain))
    assert chain is not None
    chain.run()  # the last stage's launch submits every stage it depends on first
    return {stage: ex.job_id for stage, ex in made}


def in_job() -> bool:
    return "SLURM_ARRAY_TASK_ID" in os.environ

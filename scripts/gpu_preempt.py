"""The preempt phase of scripts/gpu_validate.py: SIGTERM a training run after its first step, then resume it.

`train.py` runs eagerly (no compile) with the pre-flight gates skipped (the train phase ran them on
the same data and shape) into a new run folder, with the timed run's micro-batch, grad-accum and
sequence length, so the step in progress when the signal comes is the recipe's. Once `log.jsonl`
holds its first step the process gets SIGTERM (as torchrun forwards it to a worker); it should finish
that step, write a checkpoint and exit EXIT_PREEMPTED (training.loop.preempt_signals). The same command with
`--stop-at saved + RESUME_STEPS` then resumes: it should say it resumed at the saved step, and its
log continues the curve (finite loss, step numbers contiguous from 1).

Figures: the exit code, the seconds from the signal to the exit against torchrun's grace period
(it SIGKILLs its workers `--shutdown-timeout` seconds after forwarding the signal, default 30;
docs/reliability.md), the preemption checkpoint's step, stall / write / wait seconds and bytes (its
`checkpoint` record in log.jsonl, training.loop.checkpointer), and the resume's step and losses.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # a phase of scripts/gpu_validate.py, which imports it: not a program of its own
    if sys.argv[1:] in (["-h"], ["--help"]):
        print("usage: python scripts/gpu_validate.py [options]  (this file is its preempt phase)\n\n" + __doc__)
        sys.exit(0)
    print("error: scripts/gpu_preempt.py is the preempt phase of scripts/gpu_validate.py: run that "
          "(python scripts/gpu_validate.py --help)", file=sys.stderr)
    sys.exit(2)

from training.gates.gate_names import PREFLIGHT_NAMES  # noqa: E402
from training.runfiles import layout  # noqa: E402  (after the guard above: run as a script, `training` is not importable)
from training.runfiles.cli_harness import EXIT_PREEMPTED  # noqa: E402

MAX_STEPS = 1000  # the preempted run's --max-steps: never reached, the signal stops it first
RESUME_STEPS = 2  # the resumed run stops (--stop-at) this many steps past the preemption checkpoint
TORCHRUN_GRACE_S = 30  # torchrun's default --shutdown-timeout: SIGTERM to SIGKILL of its workers
POLL_S = 0.2  # how often log.jsonl is read while waiting for the first step
KILL_WAIT_S = 30  # a run past the budget: SIGTERM to its process group, then SIGKILL after this
RESUMED = re.compile(r"resumed from .* \(step (\d+),")  # train.py's line on a resume (training.trainer)


def skip_gates() -> list[str]:
    """--skip-gate for every pre-flight gate: the train phase measured them on this data and shape."""
    return [arg for name in PREFLIGHT_NAMES for arg in ("--skip-gate", name)]


def read_log(run: Path) -> list[dict]:
    """The run's log.jsonl records as dicts, through training.runfiles.json_records.read_log (the one reader: a last
    line still being written is left out, a damaged one is an error); [] before the file exists."""
    from training.runfiles.json_records import read_log as records

    path = run / layout.LOG
    return [r.value for r in records(path)] if path.is_file() else []


def _steps(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "loss" in r and "event" not in r]


def _stop(p: subprocess.Popen) -> int:
    """Past the budget: the whole process group stopped (SIGTERM, then SIGKILL); 124 as `timeout` says."""
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return 124


def _wait(p: subprocess.Popen, deadline: float) -> int:
    try:
        return p.wait(timeout=max(deadline - time.time(), 0))
    except subprocess.TimeoutExpired:
        return _stop(p)


def preempt_and_resume(cmd: list[str], cwd: Path, run: Path, out_log: Path, deadline: float,
                       save: Callable[[dict], None]) -> dict:
    """Run `cmd` (train.py, writing `run`) to its first step, SIGTERM it, resume it; stdout and stderr
    of both runs in `out_log`. `save(figures)` is called once the preempted run has exited (results on
    disk before the resume). Returns the figures; `preempt_ok` says whether every check held."""
    cmd = [*cmd, *skip_gates()]
    res: dict = {"preempt_run_dir": str(run), "preempt_log": str(out_log), "preempt_ok": False}
    with open(out_log, "w") as log:
        p = subprocess.Popen(cmd, cwd=cwd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        while not _steps(read_log(run)) and p.poll() is None and time.time() < deadline:
            time.sleep(POLL_S)
        if p.poll() is not None:  # a refused flag, a crash: nothing to signal
            return {**res, "preempt_exit_code": p.returncode, "preempt_error": "train.py exited before the SIGTERM"}
        if not _steps(read_log(run)):
            return {**res, "preempt_exit_code": _stop(p), "preempt_error": "train.py logged no step within the --budget-s"}
        t_signal = time.time()
        p.send_signal(signal.SIGTERM)  # to train.py alone, as torchrun forwards it to each worker
        rc = _wait(p, deadline)
        exit_s = round(time.time() - t_signal, 2)
    recs = read_log(run)
    ev = next((r for r in reversed(recs) if r.get("event") == "preempted"), {})
    saved = ev.get("step")
    ck = next((r for r in reversed(recs) if r.get("event") == "checkpoint" and r.get("step") == saved), {})
    res.update({
        "preempt_exit_code": rc, "preempt_expected_exit_code": EXIT_PREEMPTED,
        "preempt_signal_to_exit_s": exit_s, "preempt_torchrun_grace_s": TORCHRUN_GRACE_S,
        "preempt_step": saved,
        "preempt_checkpoint_stall_s": round(ck["stall_ms"] / 1e3, 3) if "stall_ms" in ck else None,
        "preempt_checkpoint_write_s": ck.get("write_s"),
        "preempt_checkpoint_wait_s": round(ck["wait_ms"] / 1e3, 3) if "wait_ms" in ck else None,
        "preempt_checkpoint_bytes": ck.get("bytes"),
    })
    res["preempt_within_torchrun_grace"] = res["preempt_signal_to_exit_s"] < TORCHRUN_GRACE_S
    save(res)
    if rc != EXIT_PREEMPTED or not saved or not ck:
        res["preempt_error"] = f"exit code {rc} (expected {EXIT_PREEMPTED}, a checkpoint and a preempted record)"
        return res
    return resume(cmd + ["--stop-at", str(saved + RESUME_STEPS)], cwd, run, out_log, deadline, saved, res)


def resume(cmd: list[str], cwd: Path, run: Path, out_log: Path, deadline: float, saved: int, res: dict) -> dict:
    """The same command again (to `--stop-at`): where it resumed, and whether its log continues the curve."""
    n_before = len(out_log.read_text(errors="replace"))
    t0 = time.time()
    with open(out_log, "a") as log:
        p = subprocess.Popen(cmd, cwd=cwd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        rc = _wait(p, deadline)
    said = RESUMED.search(out_log.read_text(errors="replace")[n_before:])
    recs = read_log(run)
    after = next((i for i, r in enumerate(recs) if r.get("event") == "preempted"), len(recs))
    new = _steps(recs[after:])
    steps = [r["step"] for r in _steps(recs)]
    res.update({
        "resume_exit_code": rc, "resume_wall_s": round(time.time() - t0, 1),
        "resumed_at_step": int(said.group(1)) if said else None,
        "resume_steps": [r["step"] for r in new], "resume_first_loss": new[0]["loss"] if new else None,
        "resume_loss_finite": bool(new) and all(math.isfinite(r["loss"]) for r in new),
        "resume_steps_contiguous": steps == list(range(1, len(steps) + 1)),
    })
    res["preempt_ok"] = (rc == 0 and res["resumed_at_step"] == saved and res["resume_loss_finite"]
                         and res["resume_steps_contiguous"] and res["resume_steps"][:1] == [saved + 1])
    if not res["preempt_ok"]:
        res["preempt_error"] = f"the resume: exit code {rc}, resumed at {res['resumed_at_step']} (saved {saved})"
    return res

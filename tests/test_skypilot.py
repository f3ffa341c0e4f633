"""deploy/skypilot/train-400m.yaml: SkyPilot's own library loads and validates it, and its setup and run
scripts, run by bash with SkyPilot's variables set, call prodip's CLIs with arguments their own parsers take.

SkyPilot lives in a venv of its own (scripts/setup.sh --dev: PRODIP_SKYPILOT_VENV, default
~/.cache/prodip/skypilot-venv; in prodip's venv it would downgrade uvicorn and click). No cloud account
is needed: `sky.Task.from_yaml_config` checks the task against SkyPilot's schema offline.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_docs import find_build_parser, parse_with

from training.runfiles.cli_harness import EXIT_PREEMPTED

TASK = REPO / "deploy" / "skypilot" / "train-400m.yaml"
SKY_VENV = Path(os.environ.get("PRODIP_SKYPILOT_VENV", "~/.cache/prodip/skypilot-venv")).expanduser()
PINNED = re.search(r"^SKYPILOT_VERSION=(\S+)", (REPO / "scripts" / "setup.sh").read_text(), re.M).group(1)
ENVS = {"RUN_URL": "s3://my-bucket/runs/400m", "DATA_URL": "s3://my-bucket/data/bn32k"}
NODE = {"SKYPILOT_NUM_NODES": "1", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        "SKYPILOT_NODE_IPS": "10.0.0.7\n"}

# runs in SkyPilot's venv: the task as SkyPilot reads it, and what its validator says about broken copies
LOAD = r"""
import copy, json, sys, yaml, sky
path, envs = sys.argv[1], json.loads(sys.argv[2])
cfg = yaml.safe_load(open(path))
secrets = [("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s")]
out = {"version": sky.__version__}
try:
    sky.Task.from_yaml(path)
except ValueError as e:
    out["without_env"] = str(e)
task = sky.Task.from_yaml_config(copy.deepcopy(cfg), env_overrides=list(envs.items()), secrets_overrides=secrets)
res = list(task.resources)
out.update(num_nodes=task.num_nodes, envs=task.envs, setup=task.setup, run=task.run,
           accelerators=sorted(a for r in res for a in r.accelerators), spot=[r.use_spot for r in res],
           job_recovery=res[0].job_recovery, secrets=sorted(task.secrets))
bad = copy.deepcopy(cfg)
bad["resources"]["job_recovery"]["recover_on_exit_codes"] = [300]
try:
    sky.Task.from_yaml_config(bad, env_overrides=list(envs.items()), secrets_overrides=secrets)
except Exception as e:
    out["invalid"] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""

RECORD = '#!/bin/sh\nprintf "%s\\n" "$(basename "$0")" "$@" > "$RECORD_DIR/$(date +%s%N)-$$"\n'


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    py = SKY_VENV / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"SkyPilot is not installed in {SKY_VENV}: scripts/setup.sh --dev installs it")
    home = tmp_path_factory.mktemp("sky-home")  # SkyPilot writes ~/.sky: never the user's
    r = subprocess.run([str(py), "-c", LOAD, str(TASK), json.dumps(ENVS)], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={"PATH": os.environ.get("PATH", ""), "HOME": str(home)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_skypilot_validates_the_task(task):
    assert task["version"] == PINNED  # the pinned SkyPilot, not whatever was lying around
    assert "RUN_URL" in task["without_env"]  # the bucket must be given: no default that trains somewhere
    assert "recover_on_exit_codes" in task["invalid"]  # the schema really is checked
    assert task["num_nodes"] == 1 and all(task["spot"]) and task["accelerators"] == ["H100", "H200"]
    assert EXIT_PREEMPTED in task["job_recovery"]["recover_on_exit_codes"]  # a SIGTERM checkpoint relaunches
    assert task["secrets"] == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(task["envs"])  # secrets never in envs


def _run_script(script: str, envs: dict, tmp: Path) -> list[list[str]]:
    """`script` run by bash in a copy of the repository layout whose python, torchrun and scripts/setup.sh
    record their arguments: the commands as the shell expands them, in order."""
    (tmp / "rec").mkdir(parents=True)
    for stub in (".venv/bin/python", ".venv/bin/torchrun", "scripts/setup.sh"):
        (tmp / stub).parent.mkdir(parents=True, exist_ok=True)
        (tmp / stub).write_text(RECORD)
        (tmp / stub).chmod(0o755)
    env = {"PATH": os.environ.get("PATH", ""), "RECORD_DIR": str(tmp / "rec"), **envs, **NODE}
    r = subprocess.run(["bash", "-c", script.replace("bash scripts/setup.sh", "scripts/setup.sh")], cwd=tmp, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [p.read_text().splitlines() for p in sorted((tmp / "rec").iterdir())]


def test_setup_and_run_call_prodip_as_documented(task, tmp_path):
    from torch.distributed.run import get_args_parser

    envs = dict(task["envs"])
    setup = _run_script(task["setup"], envs, tmp_path / "setup")
    assert setup[0] == ["setup.sh"] and setup[1][:4] == ["python", "-m", "pip", "install"]
    assert "-e" in setup[1] and ".[remote]" in setup[1]  # s3fs
    plan, train = _run_script(task["run"], envs, tmp_path / "run")
    parser = find_build_parser("training/train.py")
    assert plan[0] == "python" and plan[1] == "training/train.py" and parse_with(parser(), plan[2:]) is None
    assert train[0] == "torchrun" and parse_with(get_args_parser(), train[1:]) is None
    t = get_args_parser().parse_args(train[1:])
    assert (t.nnodes, t.node_rank, t.nproc_per_node, t.master_addr) == ("1", 0, "8", "10.0.0.7")
    args = t.training_script_args
    assert t.training_script == "training/train.py" and parse_with(parser(), args) is None
    # the same command on every relaunch (that is what resumes), the plan being that command plus --plan
    assert plan[2:] == [*args, "--plan", "--gpus", "8"]
    assert args[args.index("--out") + 1] == ENVS["RUN_URL"] and args[args.index("--data") + 1] == ENVS["DATA_URL"]
    assert args[args.index("--preset") + 1] == "400m"


def test_the_walks_cost_figure_is_what_plan_prints():
    """docs/rented.md opens with `train.py ... --plan` and the figure it prints: run that command as written
    (no GPU, no store: --plan reads and writes nothing) and find its time-and-cost line in the doc."""
    doc = (REPO / "docs" / "rented.md").read_text(encoding="utf-8")
    [line] = [x for x in doc.splitlines() if x.startswith("python training/train.py") and "--plan" in x]
    r = subprocess.run([sys.executable, *shlex.split(line)[1:]], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    [cost] = [" ".join(x.split()) for x in r.stdout.splitlines() if x.split()[:1] == ["time"]]
    assert f"`{cost}`" in " ".join(doc.split()), f"docs/rented.md should quote --plan's line: {cost}"

"""`python -m training.prepare ... --executor local|slurm|ray --tasks N` (issue 47): the prepare as
datatrove tasks. Required: the local executor at N=2 writes, byte for byte, what one process writes
from the same input; a near-duplicate pair whose halves land on different tasks is removed and
counted as one process counts it; a rerun runs only the tasks that did not finish; Slurm gets an
array job per parallel stage and each stage `afterok` on the one before, with the user's partition,
time and CPUs; bad input is one `error:` line and nothing written."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import CORPUS
from safetensors.numpy import load_file
from test_prepare_clean import decoded_docs

from training.prepare import main

# a planted pair: one word apart (Jaccard of word 5-grams ~0.8), the first file read and the last
PLANT = ("The river town keeps its market open from dawn until the evening prayers, and every stall sells "
         "something the farmers carried in on foot: bitter gourds, green chillies, river fish packed in wet "
         "leaves, bundles of jute rope, clay pots still warm from the kiln, and sweets made with date palm "
         "jaggery that the children beg for on the long walk home along the embankment road.")
NEAR = PLANT.replace("clay pots", "clay jars")
FAST = ["--workers", "1", "--no-progress", "--fertility-floor", "1.5"]
OUTPUT = {"tokenizer.model", "meta.json", "report.json", "report.md", "fertility.png", "train/shard_00000.bin",
          "val/shard_00000.bin"}


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus") / "c"
    shutil.copytree(CORPUS, root)
    (root / "aaa_plant.txt").write_text(PLANT + "\n", encoding="utf-8")
    (root / "zzz_plant.txt").write_text(NEAR + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def runs(corpus, bn_data, tmp_path_factory) -> dict[str, Path]:
    """One process, and the local executor with 2 tasks, on the same input and tokenizer."""
    root = tmp_path_factory.mktemp("runs")
    args = ["--input", str(corpus), "--tokenizer", str(bn_data / "tokenizer.model"), *FAST]
    assert main([*args, "--out", str(root / "one")]) == 0
    assert main([*args, "--out", str(root / "two"), "--executor", "local", "--tasks", "2"]) == 0
    return {"one": root / "one", "two": root / "two", "work": root / "two.work", "args": args}


def test_local_executor_writes_what_one_process_writes(runs):
    one, two = tree(runs["one"]), tree(runs["two"])
    assert set(one) >= OUTPUT, sorted(one)
    assert sorted(two) == sorted(one)
    differ = [k for k in one if one[k] != two[k]]
    assert not differ, f"differ from the one-process run: {differ}"
    plan = json.loads((runs["work"] / "plan.json").read_text())
    assert plan["tasks"] == 2 and all(plan["sources"]), plan["sources"]  # both tasks had files to do


def test_near_duplicate_split_across_tasks_is_removed(runs):
    plan = json.loads((runs["work"] / "plan.json").read_text())
    task_of = {Path(f).name: t for t, files in enumerate(plan["sources"]) for f in files}
    assert (task_of["aaa_plant.txt"], task_of["zzz_plant.txt"]) == (0, 1)  # the halves on different tasks
    dups = load_file(runs["work"] / "dedup" / "00000" / "arrays.safetensors")
    assert 2 in dups["dup_00001"].tolist()  # task 1's copy found near task 0's by the dedup stage
    kept = "\n".join(decoded_docs(runs["two"]))
    assert "clay pots still warm" in kept and "clay jars still warm" not in kept
    dedup = json.loads((runs["two"] / "report.json").read_text())["dedup"]
    one = json.loads((runs["one"] / "report.json").read_text())["dedup"]
    assert dedup["near_duplicates"] == one["near_duplicates"] >= 1
    assert any("clay jars" in s for s in dedup["examples"]["near_duplicate"])


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_merge_names_an_unfinished_task_and_a_rerun_runs_only_it(runs, capsys, tmp_path):
    work, two = runs["work"], runs["two"]
    marker = work / "logs" / "encode" / "completions" / "00001"
    marker.unlink()  # encode task 1 did not finish
    shutil.rmtree(work / "encode" / "00001")
    assert main(["merge", str(work), "--out", str(tmp_path / "m")]) == 2
    assert "task 1 of encode did not finish" in _one_error(capsys)
    assert not (tmp_path / "m").exists()
    before = {p: p.stat().st_mtime_ns for p in work.glob("*/*/task.json")}
    assert main([*runs["args"], "--out", str(two), "--executor", "local", "--tasks", "2", "--force"]) == 0
    rewritten = sorted(p.relative_to(work).as_posix() for p in work.glob("*/*/task.json")
                       if before.get(p) != p.stat().st_mtime_ns)
    assert rewritten == ["encode/00001/task.json"]  # scan, dedup and encode task 0 were not run again
    assert tree(two) == tree(runs["one"])


def test_a_task_folder_from_another_tokenizer_is_refused_by_name(runs, capsys, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(runs["work"], work)
    head = work / "encode" / "00000" / "task.json"
    head.write_text(json.dumps({**json.loads(head.read_text()), "tokenizer_sha256": "0" * 64}))
    assert main(["merge", str(work), "--out", str(tmp_path / "m")]) == 2
    line = _one_error(capsys)
    assert f"{work / 'encode' / '00000'} was written with another tokenizer" in line, line
    assert not (tmp_path / "m").exists()


BAD = {
    "tasks 0": (["--executor", "local", "--tasks", "0"], "argument --tasks"),
    "slurm time 4h": (["--executor", "slurm", "--partition", "cpu", "--time", "4h"], "--time '4h'"),
    "slurm time 1:2:3:4": (["--executor", "slurm", "--partition", "cpu", "--time", "1:2:3:4"], "--time"),
    "slurm partition": (["--executor", "slurm", "--partition", "cpu nodes", "--time", "60"], "--partition 'cpu nodes'"),
    "slurm no partition": (["--executor", "slurm", "--time", "60"], "needs --partition"),
    "slurm cpus 0": (["--executor", "slurm", "--partition", "cpu", "--time", "60", "--cpus-per-task", "0"],
                     "argument --cpus-per-task"),
    "partition on local": (["--executor", "local", "--partition", "cpu"], "--partition is a cluster option"),
    "tasks without executor": (["--tasks", "2"], "--tasks goes with --executor"),
    "no tokenizer": (["--executor", "local", "--tasks", "2", "--no-tokenizer"], "needs --tokenizer"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_executor_input_is_one_line_and_writes_nothing(case, corpus, bn_data, capsys, tmp_path):
    extra, expect = BAD[case]
    tok = [] if "--no-tokenizer" in extra else ["--tokenizer", str(bn_data / "tokenizer.model")]
    extra = [a for a in extra if a != "--no-tokenizer"]
    out = tmp_path / "data"
    assert main(["--input", str(corpus), "--out", str(out), *tok, *FAST, *extra]) == 2
    assert expect in _one_error(capsys)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("missing", ["datatrove.executor.local", "ray"])
def test_an_executor_not_installed_says_what_to_install(missing, corpus, bn_data, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as when the package is absent
    executor = "ray" if missing == "ray" else "local"
    assert main(["--input", str(corpus), "--out", str(tmp_path / "d"), "--tokenizer", str(bn_data / "tokenizer.model"),
                 *FAST, "--executor", executor]) == 2
    line = _one_error(capsys)
    assert f"pip install 'prodip[{'cluster-ray' if executor == 'ray' else 'cluster'}]'" in line, line
    assert not any(tmp_path.iterdir())


FAKE_SBATCH = """#!/bin/bash
n=$(( $(cat "$SBATCH_LOG/n" 2>/dev/null || echo 100) + 1 ))
echo $n > "$SBATCH_LOG/n"
printf '%s\\n' "$@" > "$SBATCH_LOG/args_$n"
cp "${@: -1}" "$SBATCH_LOG/script_$n"
echo "Submitted batch job $n"
"""


def _fake_bin(folder: Path, monkeypatch) -> Path:
    folder.mkdir()
    (folder / "sbatch").write_text(FAKE_SBATCH)
    (folder / "scontrol").write_text("#!/bin/bash\necho localhost\n")  # `scontrol show hostnames`
    for f in folder.iterdir():
        f.chmod(0o755)
    log = folder.parent / "sbatch_log"
    log.mkdir()
    monkeypatch.setenv("SBATCH_LOG", str(log))
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return log


def test_slurm_jobs_are_written_chained_and_run(runs, corpus, bn_data, capsys, tmp_path, monkeypatch):
    """The sbatch scripts and dependencies (a fake sbatch records them), then each job's command run as
    Slurm would run it (SLURM_ARRAY_TASK_ID per array index): the data folder the one process writes."""
    empty = tmp_path / "nobin"
    empty.mkdir()
    args = ["--input", str(corpus), "--tokenizer", str(bn_data / "tokenizer.model"), *FAST, "--executor", "slurm",
            "--tasks", "2", "--partition", "cpu", "--time", "1:00:00", "--cpus-per-task", "1"]
    with monkeypatch.context() as m:
        m.setenv("PATH", str(empty))
        assert main([*args, "--out", str(tmp_path / "x")]) == 2
        assert "sbatch not found" in _one_error(capsys)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.work").exists()
    log = _fake_bin(tmp_path / "bin", monkeypatch)
    out, work = tmp_path / "data", tmp_path / "data.work"
    assert main([*args, "--out", str(out)]) == 0
    assert "submitted Slurm jobs" in capsys.readouterr().out
    jobs = {}  # stage -> (job id, script, sbatch arguments)
    for script in sorted(log.glob("script_*")):
        n = script.name.split("_")[1]
        text, argv = script.read_text(), (log / f"args_{n}").read_text().split("\n")
        if "training.prepare task" in text:
            jobs[text.split("training.prepare task ")[1].split()[0]] = (n, text, argv)
    assert list(jobs) == ["scan", "dedup", "encode", "merge"]  # submitted in dependency order
    for stage, (_, text, _) in jobs.items():
        for line in ("--partition=cpu", "--time=1:00:00", "--cpus-per-task=1",
                     f"--array=0-{1 if stage in ('scan', 'encode') else 0}"):
            assert f"#SBATCH {line}\n" in text, (stage, line, text)
        assert f"-m training.prepare task {stage} --work {work} --workers 1" in text
    for before, stage in zip(["scan", "dedup", "encode"], ["dedup", "encode", "merge"]):
        assert f"--dependency=afterok:{jobs[before][0]}" in jobs[stage][2], (stage, jobs[stage][2])
    assert not list(work.rglob("executor.pik")), "the pickled executor was left behind"
    assert not out.exists()
    monkeypatch.setenv("SLURM_NODELIST", "localhost")
    for stage in ("scan", "dedup", "encode", "merge"):
        for i in range(2 if stage in ("scan", "encode") else 1):
            monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(i))
            assert main(["task", stage, "--work", str(work), "--workers", "1"]) == 0
    assert tree(out) == tree(runs["one"])

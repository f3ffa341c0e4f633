"""scripts/gpu_validate.py on CPU: its flags, its results written after every phase (so a GPU run
stopped by a time limit keeps what finished), its SDPA probe, and a dry run end to end; and
scripts/gpu_check.sh, the one command that wraps it on a fresh GPU machine, dry-run on CPU in a
fresh virtual environment that has torch and lacks some of prodip's needs (installed from a wheelhouse)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from conftest import REPO


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_validate", REPO / "scripts" / "gpu_validate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gv = load_script()


@pytest.mark.parametrize("argv, flag", [(["--steps", "0"], "--steps"), (["--seq-len", "x"], "--seq-len"),
                                        (["--hourly-usd", "-1"], "--hourly-usd"), (["--preset", "2b"], "--preset"),
                                        (["--device", "tpu"], "--device")])
def test_bad_flags_are_refused(argv: list[str], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        gv.build_parser().parse_args(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err
    assert gv.main(argv) == 2  # one `error:` line naming the flag, as every prodip CLI: no usage block
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err and err.count("\n") == 1, err


def test_grad_accum_defaults_to_the_presets_recipe() -> None:
    """#27 item 8: the timed run is the 400m recipe, 16 x 16 micro-batches of 2048 (#48: 0.5 M tokens per
    optimizer step, training/presets/400m.toml); --grad-accum still overrides it."""
    a = gv.parse_args([])
    assert (a.preset, a.batch_size, a.grad_accum, a.seq_len) == ("400m", 16, 16, 2048)
    assert a.grad_accum_from == "training/presets/400m.toml [train]" and a.eval_batches == 4
    assert gv.parse_args(["--grad-accum", "4"]).grad_accum == 4
    # "45% MFU by step 8": every step logged past step 8, and the timed steps at the 150 k tokens/s target
    # take a fraction of the 450 s budget (gates, compile and the later phases need the rest)
    assert a.steps > 8 and a.steps * 16 * 16 * 2048 / 150_000 < gv.BUDGET_S / 4


def test_out_that_is_a_file_is_refused_before_any_phase(tmp_path: Path, capsys) -> None:
    f = tmp_path / "file"
    f.write_text("keep")
    assert gv.main(["--out", str(f), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out") and err.count("\n") == 1
    assert f.read_text() == "keep"


def read(out: Path) -> dict:
    return json.loads((out / gv.RESULTS_JSON).read_text())


def test_results_are_on_disk_during_and_after_every_phase(tmp_path: Path) -> None:
    rep = gv.Results(tmp_path / "out", {"steps": 1})
    with rep.phase("environment") as res:
        assert read(tmp_path / "out")["phases"] == [{"name": "environment", "status": "running"}]
        res["gpu"] = "NVIDIA H200 NVL"
    with pytest.raises(RuntimeError), rep.phase("train"):
        raise RuntimeError("CUDA out of memory\ndetails")
    # what a timed-out or crashed run leaves: the finished phase's figures, the failed one named
    data = read(tmp_path / "out")
    assert data["complete"] is False and data["results"] == {"gpu": "NVIDIA H200 NVL"}
    assert [(p["name"], p["status"]) for p in data["phases"]] == [("environment", "ok"), ("train", "failed")]
    assert data["phases"][1]["error"] == "RuntimeError: CUDA out of memory"
    md = (tmp_path / "out" / gv.RESULTS_MD).read_text()
    assert "(incomplete)" in md and "| train | failed: RuntimeError: CUDA out of memory |" in md
    assert "| gpu | NVIDIA H200 NVL |" in md
    rep.finish()
    assert read(tmp_path / "out")["complete"] is True
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_sdpa_probe_names_the_kernel_dispatch_chose() -> None:
    probe = gv.sdpa_kernels("tiny", 64, "cpu")
    assert probe["sdpa_kernel"] in {"flash (CPU)", "math"}, probe  # CPU's two SDPA paths
    if probe["sdpa_kernel"] == "flash (CPU)":  # a fused kernel has a backward op of its own; math has none
        assert any(op.endswith("_backward") for op in probe["sdpa_ops"]), probe


def test_sdpa_probe_without_gqa_has_one_form(monkeypatch) -> None:
    """n_kv_heads == n_heads: shared and expanded K/V are the same call, so only one form is timed."""
    import training.model.decoder as M

    real = M.preset
    monkeypatch.setattr(M, "preset", lambda name, **kw: real(name, **{**kw, "n_kv_heads": real(name).n_heads}))
    probe = gv.sdpa_backends("tiny", 16, 1, "cpu", reps=1)
    assert probe["sdpa_expanded_fwd_bwd_ms"] is None and probe["sdpa_fastest_expanded"] is None
    assert probe["sdpa_best"].endswith(" (enable_gqa)") and "(kv 4)" in probe["sdpa_shape"]


def test_dry_run_on_cpu_writes_every_phase(tmp_path: Path, capsys) -> None:
    """Every phase runs; train.py refuses the missing data folder (exit 2), which the results say,
    and the measure phase reports no speed rather than a made-up one."""
    out = tmp_path / "out"
    rc = gv.main(["--device", "cpu", "--preset", "tiny", "--seq-len", "64", "--batch-size", "2", "--steps", "2",
                  "--no-compile", "--skip-1b", "--data", str(tmp_path / "no-data"), "--out", str(out)])
    assert rc == 2
    data = read(out)
    assert data["complete"] is True
    assert [(p["name"], p["status"]) for p in data["phases"]] == [
        ("environment", "ok"), ("sdpa", "ok"), ("data", "ok"), ("train", "exit code 2"), ("measure", "ok"),
        ("eager", "ok"), ("preempt", "skipped: the train phase trained no step")]
    r = data["results"]
    assert r["gpu"] == "cpu" and r["peak_flops"] is None and r["train_exit_code"] == 2 and r["sdpa_kernel"]
    # no --grad-accum: tiny's recipe (training/presets/tiny.toml sets none: TrainConfig's 1)
    assert r["grad_accum"] == 1 and r["grad_accum_from"] == "training/presets/tiny.toml [train]"
    assert r["tokens_per_optimizer_step"] == 2 * 1 * 64
    assert r["tokens_per_s"] is None and r["mfu"] is None and r["mfu_6ltd"] is None
    assert r["flops_per_token"] > r["flops_per_token_6ltd"] > 0
    assert r["eager_tokens_per_s"] > 0 and r["eager_mfu"] is None  # measured for real; no MFU on CPU
    assert "compile_speedup" not in r  # nothing compiled ran to compare
    # each SDPA backend forced and timed: CPU has math (and its flash kernel), never cuDNN
    assert r["sdpa_fwd_bwd_ms"]["math"] > 0 and r["sdpa_fwd_bwd_ms"]["cudnn_attention"].startswith("unavailable")
    assert r["sdpa_fastest"] in r["sdpa_fwd_bwd_ms"]
    # and again with K/V pre-expanded (repeat_interleave) instead of enable_gqa: the best of both named
    assert r["sdpa_expanded_fwd_bwd_ms"]["math"] > 0
    assert r["sdpa_expanded_fwd_bwd_ms"]["cudnn_attention"].startswith("unavailable")
    assert r["sdpa_fastest_expanded"] in r["sdpa_expanded_fwd_bwd_ms"]
    backend, form = r["sdpa_best"].removesuffix(")").split(" (")
    ms = r["sdpa_fwd_bwd_ms" if form == "enable_gqa" else "sdpa_expanded_fwd_bwd_ms"][backend]
    assert form in {"enable_gqa", "expanded"} and ms == min(
        v for m in (r["sdpa_fwd_bwd_ms"], r["sdpa_expanded_fwd_bwd_ms"]) for v in m.values() if isinstance(v, float))
    # the block's projections timed fused and unfused; CPU does not fuse by default
    assert r["proj_fwd_bwd_ms"]["fused"] > 0 and r["proj_fwd_bwd_ms"]["unfused"] > 0
    assert r["proj_fused_default"] is False
    # peak memory: no CUDA counter here, but the plan's estimate for the model that ran
    assert r["peak_mem_gb"] is None and r["eager_peak_mem_gb"] is None and r["peak_mem_estimate_gb"] > 0
    assert r["gates"] == [] and r["train_timeout_s"] > 0


def test_a_phase_that_no_longer_fits_the_budget_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    gv.main(["--device", "cpu", "--preset", "tiny", "--seq-len", "64", "--batch-size", "2", "--steps", "2",
             "--no-compile", "--data", str(tmp_path / "no-data"), "--out", str(out), "--budget-s", "1"])
    data = read(out)
    assert data["complete"] is True and data["results"]["train_timeout_s"] == 1
    assert data["phases"][-2] == {"name": "eager", "status": "skipped: over the --budget-s", "wall_s": 0.0}
    assert data["phases"][-1]["name"] == "preempt" and data["phases"][-1]["status"].startswith("skipped: ")


@pytest.mark.parametrize("left, reserve, cap, want", [
    (600, 195, 420, 405),  # room for both: the rest after the reserve
    (2000, 195, 420, 420),  # never past --train-timeout-s
    (163, 135, 420, 150),  # the H200 run that left train.py 24 s: now the floor, the later phases skipped if late
    (100, 135, 420, 100),  # less than the floor left: all of it
    (0.4, 135, 420, 1),  # nothing left: 1 s, so train.py is still started and stopped (what it logged is kept)
    (163, 135, 60, 60),  # a --train-timeout-s below the floor wins
])
def test_the_train_phase_is_not_starved_by_the_reserve_of_later_phases(left, reserve, cap, want) -> None:
    """Expectations from the rule: train gets left - reserve, but at least min(150 s floor, left), at
    most the cap, at least 1 (the 400m phase took 90 s on an H200)."""
    assert gv.TRAIN_FLOOR_S == 150
    assert gv.train_timeout(left, reserve, cap) == want


def test_graph_breaks_and_recompiles_are_counted_from_dynamos_own_log(tmp_path: Path) -> None:
    """Control for compile_counts: the lines TORCH_LOGS=graph_breaks,recompiles writes (torch 2.13's format)."""
    log = tmp_path / "run.stderr.log"
    log.write_text(
        "V1203 07:40:32.521000 2485 torch/_dynamo/symbolic_convert.py:5124] [0/0] [__graph_breaks] Graph break in "
        "user code at /tmp/x.py:5\n"
        "V1203 07:40:50.444000 2485 torch/_dynamo/guards.py:5396] [0/1] [__recompiles] Recompiling function f in "
        "/tmp/x.py:2\n"
        "V1203 07:40:50.507000 2485 torch/_dynamo/symbolic_convert.py:5131] [0/1] [__graph_breaks] Graph break (user "
        "stack suppressed due to duplicate graph break) in user code at /tmp/x.py:5\n")
    assert gv.compile_counts(log) == {"graph_breaks": 2, "recompiles": 1, "compile_log": str(log)}
    assert gv.compile_counts(tmp_path / "none")["graph_breaks"] == 0


FAKE_TRAIN = """import json, sys, time
from pathlib import Path
run = Path(sys.argv[1])
run.mkdir(parents=True)
(run / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 7.0}) + "\\n")
time.sleep(60)
"""


@pytest.mark.parametrize("script, error", [
    ("import sys; sys.exit(5)", "train.py exited before the SIGTERM"),  # e.g. a refused flag
    (FAKE_TRAIN, "exit code -15 (expected 3"),  # killed by the SIGTERM: no checkpoint, nothing to resume
])
def test_a_run_that_does_not_stop_on_a_checkpoint_fails_the_preempt_phase(script: str, error: str,
                                                                          tmp_path: Path) -> None:
    import gpu_preempt  # beside gpu_validate.py, which put its folder on the path

    saved: list[dict] = []
    run = tmp_path / "run"
    res = gpu_preempt.preempt_and_resume([sys.executable, "-c", script, str(run)], tmp_path, run,
                                         tmp_path / "run.log", time.time() + 30, save=saved.append)
    assert res["preempt_ok"] is False and error in res["preempt_error"], res
    assert "resume_exit_code" not in res  # nothing was resumed
    # a run that got the signal: its figures handed over to be written before anything else happens
    assert [r["preempt_exit_code"] for r in saved] == ([-15] if "preempt_signal_to_exit_s" in res else [])


# ----------------------------------------------------------------------- scripts/gpu_check.sh
def gpu_check(*argv: str, python: Path | str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env={**os.environ, "PYTHON": str(python), "OMP_NUM_THREADS": "2"})


@pytest.mark.parametrize("argv, needle", [([], "--out DIR is required"), (["--out", "x", "--budget-s", "0"], "--budget-s"),
                                          (["--out", "x", "--data", "/nonexistent"], "--data"),
                                          (["--out", "x", "--bogus"], "unknown option --bogus")])
def test_gpu_check_refuses_bad_flags_in_one_line(argv: list[str], needle: str, tmp_path: Path) -> None:
    p = gpu_check(*[str(tmp_path / a) if a == "x" else a for a in argv])
    assert p.returncode == 2 and p.stderr.startswith("error: ") and needle in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1 and not (tmp_path / "x").exists()


FRESH_LACKS = ("tqdm", "datasketch")  # pure-Python needs the fresh machine lacks: they come from the wheelhouse


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions `names` need, their own requirements included (markers evaluated)."""
    from packaging.requirements import Requirement

    out: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonical(todo.pop())
        if name in out:
            continue
        out[name] = dist = md.distribution(name)
        todo += [r.name for r in map(Requirement, dist.requires or []) if not r.marker or r.marker.evaluate({"extra": ""})]
    return out


def fresh_python(venv: Path) -> Path:
    """A virtual environment (no system site packages) as a fresh GPU machine has it: torch and what torch
    needs, pip, and gpu_check.sh's NEEDS but FRESH_LACKS; this venv's installed copies, linked into one
    folder that a .pth file puts on the path (no copy of torch)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    from packaging.requirements import Requirement

    needs = re.search(r'^NEEDS="([^"]*)"', (REPO / "scripts" / "gpu_check.sh").read_text(), re.M).group(1)
    dists = [Requirement(pair.split("=", 1)[1]).name for pair in needs.split()]  # import=requirement
    assert set(FRESH_LACKS) <= set(dists)
    machine = closure(["torch", "pip", *dists])
    for lacked in FRESH_LACKS:
        del machine[canonical(lacked)]
    site = venv / "machine-site"
    site.mkdir()
    for dist in machine.values():
        assert dist.files is not None, dist.metadata["Name"]
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
    [purelib] = venv.glob("lib/python3.*/site-packages")
    (purelib / "machine.pth").write_text(f"{site}\n")
    return venv / "bin" / "python"


def wheel_of(name: str, wheelhouse: Path) -> Path:
    """A wheel of an installed pure-Python distribution, rebuilt offline: its files and .dist-info (less the
    installer's own records), with a RECORD of their hashes as the wheel format requires."""
    dist = md.distribution(name)
    files = [f for f in dist.files if f.parts[0] != ".." and "__pycache__" not in f.parts
             and f.name not in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    tag = re.search(r"^Tag: (.+)$", dist.read_text("WHEEL"), re.M).group(1)
    assert tag.endswith("-none-any"), tag  # pure Python: the wheel is the installed files
    whl = wheelhouse / f"{canonical(name).replace('-', '_')}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            data = Path(dist.locate_file(f)).read_bytes()
            z.writestr(f.as_posix(), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{f.as_posix()},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return whl


def test_gpu_check_on_a_fresh_machine_installs_from_a_wheelhouse_then_dry_runs(bn_data: Path, tmp_path: Path) -> None:
    """#27 item 8: the one command a fresh GPU box runs, dry-run on CPU, in a venv that has torch but lacks
    FRESH_LACKS. A wheelhouse without one of them: exit 2, one error line naming the log. With both: they
    are installed from it, then every phase of gpu_validate.py runs within the budget (a real tiny train.py
    run with its gates; SIGTERM and resume), JSON + Markdown in --out."""
    py = fresh_python(tmp_path / "venv")
    lacks = subprocess.run([py, "-c", "import torch, numpy, matplotlib\nimport tqdm"], capture_output=True, text=True)
    assert "No module named 'tqdm'" in lacks.stderr, lacks.stderr  # the machine is as described
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel_of("tqdm", wheels)

    failed = tmp_path / "failed"
    p = gpu_check("--out", str(failed), "--data", str(bn_data), "--wheelhouse", str(wheels), "--dry-run", python=py)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert str(failed / "gpu_check.log") in p.stderr and "datasketch" in (failed / "gpu_check.log").read_text()
    assert not (failed / gv.RESULTS_JSON).exists()

    wheel_of("datasketch", wheels)
    out = tmp_path / "out"
    p = gpu_check("--out", str(out), "--data", str(bn_data), "--wheelhouse", str(wheels), "--dry-run",
                  "--budget-s", "300", python=py)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    log = (out / "gpu_check.log").read_text()
    installing = next(line for line in log.splitlines() if line.startswith("installing "))
    assert all(name in installing for name in FRESH_LACKS) and installing.endswith(f" from {wheels}"), log
    where = subprocess.run([py, "-c", "import tqdm, datasketch; print(tqdm.__file__, datasketch.__file__)"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(f).is_relative_to(tmp_path / "venv" / "lib") for f in where), where  # installed in the venv

    data = read(out)
    assert data["complete"] is True and data["args"]["data"] == str(bn_data) and data["args"]["budget_s"] <= 300
    assert [q["name"] for q in data["phases"]] == ["environment", "sdpa", "data", "train", "measure", "eager",
                                                   "preempt"]
    assert all(q["status"] == "ok" for q in data["phases"]), data["phases"]
    assert (out / gv.RESULTS_MD).is_file() and "scripts/gpu_validate.py" in log
    r = data["results"]
    # the dry run's own recipe: grad-accum 2 given, so 2 x 2 x 64 tokens per optimizer step, every step logged
    assert r["grad_accum"] == 2 and r["grad_accum_from"] == "--grad-accum" and r["tokens_per_optimizer_step"] == 256
    assert r["train_exit_code"] == 0 and r["steps_logged"] == 4 and r["tokens_per_s"] > 0
    assert r["val_loss"] > 0  # one validation, at the last step
    # each gate's value next to its threshold (compiled_vs_eager: the errors against the tolerances)
    gates = {g["name"]: g for g in r["gates"]}
    assert gates["compiled_vs_eager"]["passed"] is True
    assert gates["compiled_vs_eager"]["threshold"].startswith("rel. L2 error <=")
    assert 0 <= gates["compiled_vs_eager"]["value"] < 1
    assert r["graph_breaks"] == 0 and r["recompiles"] == 0 and Path(r["compile_log"]).is_file()
    assert r["eager_tokens_per_s"] > 0

    # SIGTERM after the first step: a checkpoint and exit 3 (docs/reliability.md: "exits 3 ... requeue on
    # exit status 3"), well within torchrun's 30 s grace for a tiny model; the resume starts at the saved step
    saved = r["preempt_step"]
    assert r["preempt_exit_code"] == 3 and saved >= 1 and r["preempt_ok"] is True
    assert 0 < r["preempt_signal_to_exit_s"] < r["preempt_torchrun_grace_s"] == 30
    assert r["preempt_within_torchrun_grace"] is True
    ckpt = Path(r["preempt_run_dir"]) / "checkpoints" / f"step_{saved:07d}"
    assert r["preempt_checkpoint_bytes"] == sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file()) > 0
    assert r["preempt_checkpoint_stall_s"] >= 0 and r["preempt_checkpoint_write_s"] > 0
    assert r["resume_exit_code"] == 0 and r["resumed_at_step"] == saved
    assert r["resume_steps"] == [saved + 1, saved + 2] and math.isfinite(r["resume_first_loss"])
    steps = [json.loads(x)["step"] for x in (ckpt.parents[1] / "log.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == list(range(1, saved + 3)) and r["resume_steps_contiguous"] is True

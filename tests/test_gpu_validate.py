"""scripts/gpu_validate.py on CPU: its flags, its results written after every phase (so a GPU run
stopped by a time limit keeps what finished), its SDPA probe, and a dry run end to end; and
scripts/gpu_check.sh, the one command that wraps it on a fresh GPU machine, dry-run on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
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
    import training.model as M

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
        ("eager", "ok")]
    r = data["results"]
    assert r["gpu"] == "cpu" and r["peak_flops"] is None and r["train_exit_code"] == 2 and r["sdpa_kernel"]
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
    assert data["phases"][-1] == {"name": "eager", "status": "skipped: over the --budget-s", "wall_s": 0.0}


def test_dry_run_on_cpu_trains_and_reports_the_gates(bn_data: Path, tmp_path: Path) -> None:
    """A real (tiny, CPU) train.py run with every pre-flight gate: the measure phase reads its log and
    gates.json, so each gate's value stands next to its threshold (compiled_vs_eager: the errors
    against the tolerances)."""
    out = tmp_path / "out"
    rc = gv.main(["--device", "cpu", "--preset", "tiny", "--seq-len", "64", "--batch-size", "2", "--steps", "10",
                  "--no-compile", "--data", str(bn_data), "--out", str(out)])
    data = read(out)
    assert rc == 0, data
    r = data["results"]
    assert r["train_exit_code"] == 0 and r["steps_logged"] == 10 and r["tokens_per_s"] > 0
    assert r["val_loss"] > 0  # one validation, at the last step
    gates = {g["name"]: g for g in r["gates"]}
    assert gates["compiled_vs_eager"]["passed"] is True
    assert gates["compiled_vs_eager"]["threshold"].startswith("rel. L2 error <=")
    assert 0 <= gates["compiled_vs_eager"]["value"] < 1
    assert r["graph_breaks"] == 0 and r["recompiles"] == 0 and Path(r["compile_log"]).is_file()


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


# ----------------------------------------------------------------------- scripts/gpu_check.sh
def gpu_check(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "2"})


@pytest.mark.parametrize("argv, needle", [([], "--out DIR is required"), (["--out", "x", "--budget-s", "0"], "--budget-s"),
                                          (["--out", "x", "--data", "/nonexistent"], "--data"),
                                          (["--out", "x", "--bogus"], "unknown option --bogus")])
def test_gpu_check_refuses_bad_flags_in_one_line(argv: list[str], needle: str, tmp_path: Path) -> None:
    p = gpu_check(*[str(tmp_path / a) if a == "x" else a for a in argv])
    assert p.returncode == 2 and p.stderr.startswith("error: ") and needle in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1 and not (tmp_path / "x").exists()


def test_gpu_check_dry_run_on_cpu_writes_every_phase(bn_data: Path, tmp_path: Path) -> None:
    """#27 item 8: the one command a fresh GPU box runs, dry-run on CPU: its needs found installed, then
    gpu_validate.py's phases within the budget, JSON + Markdown in --out."""
    out = tmp_path / "out"
    p = gpu_check("--out", str(out), "--data", str(bn_data), "--dry-run", "--budget-s", "300")
    data = read(out)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert data["complete"] is True and data["args"]["data"] == str(bn_data) and data["args"]["budget_s"] <= 300
    assert [q["name"] for q in data["phases"]] == ["environment", "sdpa", "data", "train", "measure", "eager"]
    assert all(q["status"] == "ok" for q in data["phases"]), data["phases"]
    assert data["results"]["steps_logged"] == 4 and data["results"]["tokens_per_s"] > 0
    assert data["results"]["graph_breaks"] == 0 and data["results"]["recompiles"] == 0
    assert (out / gv.RESULTS_MD).is_file()
    log = (out / "gpu_check.log").read_text()
    assert "every pure-Python need is installed" in log and "scripts/gpu_validate.py" in log

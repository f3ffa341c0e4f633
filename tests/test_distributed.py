"""torchrun on CPU (gloo, 2 processes): DDP equals a single process with the doubled batch, FSDP2
likewise, save/resume under both continues the same curve, the pre-flight gradient-flow gate judges
the wrapped model on every rank, and the sharded data covers each window once per epoch."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import preloaded
import pytest
import torch
from conftest import REPO, run_train

from training.checkpoint import checkpoint_io as ckpt
from training.data.loaders import TokenStream, WindowLoader
from training.runfiles import layout

STEPS = 8
COMMON = ["--preset", "tiny", "--seq-len", "64", "--max-steps", str(STEPS), "--eval-every", "4", "--save-every", "100",
          "--log-every", "1000", "--lr", "3e-3", "--warmup-steps", "2", "--device", "cpu", "--eval-batches", "2"]
TORCHRUN_TIMEOUT_S = 600
SAME_VAL_ROWS = ("--eval-batches", "4")  # batch-size 2 on 2 ranks: COMMON's 2 evaluation batches of the single run's 8 rows
FP32_TOL = 2e-5  # relative: DDP/FSDP reduce in a different order than one process (fp32 rounding only)
FSDP_TOL = 1e-4  # FSDP2 also reduce-scatters and all-gathers in fp32: slightly more reordering


# torch.distributed.run itself, its workers forked from the preloaded interpreter (tests/torchrun_forked.py:
# ~8 of a 2-rank world's ~20 CPU-seconds were the workers' cold starts)
TORCHRUN = [sys.executable, str(REPO / "tests" / "torchrun_forked.py")]


def torchrun(script: Path, *args: str, nproc: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    # --standalone: a local c10d rendezvous on a free port (several test runs can share the machine)
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    p = preloaded.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=TORCHRUN_TIMEOUT_S,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-4000:]}")
    return p


def train_dist(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return torchrun(REPO / "training" / "train.py", *args, check=check)


def steps(run: Path) -> list[dict]:
    """log.jsonl's step records (event records, such as each checkpoint's timings, left out)."""
    return [r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if "event" not in r]


def assert_same_curve(a: list[dict], b: list[dict], tol: float = FP32_TOL) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= tol * max(1.0, abs(x["loss"])), (x["step"], x["loss"], y["loss"])
        assert ("val_loss" in x) == ("val_loss" in y), x["step"]
        if "val_loss" in x:  # the validation windows are sharded too: same set, same mean
            assert abs(x["val_loss"] - y["val_loss"]) <= tol * max(1.0, abs(x["val_loss"])), x["step"]


def assert_rank0_wrote_once(p: subprocess.CompletedProcess, run: Path) -> None:
    """Rank 0 alone prints and logs: one banner, one gate table, each step recorded once."""
    assert p.stdout.count("prodip pretrain:") == 1 and p.stdout.count("| gate |") <= 1, p.stdout[-2000:]
    recs = [r["step"] for r in steps(run) if "loss" in r]
    assert len(recs) == len(set(recs)), recs
    assert not list((run / "checkpoints").glob(ckpt.TMP_PREFIX + "*"))


@pytest.fixture(scope="module")
def single(bn_data: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    run_train(*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "8")
    return out


def test_ddp_matches_single_process_with_double_batch(bn_data: Path, single: Path, tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    p = train_dist(*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "4")
    assert "2x cpu" in p.stdout and "DDP" in p.stdout
    assert layout.read_run_config(out)["train"]["batch_size"] == 4
    assert_rank0_wrote_once(p, out)
    assert json.loads((out / "gates.json").read_text())["passed"]
    assert_same_curve(steps(single), steps(out))
    # the DDP checkpoint is an ordinary one: no "module." prefixes, and the single-process reader loads it
    w, ws = ckpt.load(out).weights, ckpt.load(single).weights
    assert set(w) == set(ws)
    assert max((w[k] - ws[k]).abs().max().item() for k in w) < 1e-4
    model, ck = ckpt.load_model(out)
    ref, _ = ckpt.load_model(single)
    x = torch.randint(0, ck.config.vocab_size, (1, 32))
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x), atol=1e-3)
    assert ck.state["world_size"] == 2


def test_ddp_kill_and_resume_continues_the_same_curve(bn_data: Path, single: Path, tmp_path: Path) -> None:
    # micro-batch 2 x grad-accum 2 x 2 ranks = the single run's 8 rows: exercises DDP's no_sync too.
    # Validation counts micro-batches (batch-size rows per rank), not optimizer steps: 4 x 2 x 2 rows
    # are the single run's 2 x 8, the same windows.
    args = [*COMMON, "--data", str(bn_data), "--out", str(tmp_path / "ddp"), "--batch-size", "2", "--grad-accum", "2",
            *SAME_VAL_ROWS]
    train_dist(*args, "--stop-at", "4")
    assert ckpt.latest(tmp_path / "ddp").name == ckpt.step_dir_name(4)
    assert [r["step"] for r in steps(tmp_path / "ddp")] == [1, 2, 3, 4]
    p = train_dist(*args)
    assert "resumed from" in p.stdout
    assert_same_curve(steps(single), steps(tmp_path / "ddp"))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_compiled_blocks_survive_wrapping(bn_data: Path, single: Path, tmp_path: Path, mode: str) -> None:
    """#27 item 1: --compile compiles each block before DDP/FSDP2 wrapping. On every rank dynamo breaks no
    graph, compiles one graph (all blocks share it), and compiles nothing once training started (the two
    validations run the eager code); the losses follow the eager single process within the compile gate's
    fp32 tolerance."""
    from training.gates.model_gates import TOLERANCE

    out = tmp_path / mode
    fsdp = ["--fsdp"] if mode == "fsdp" else []
    p = torchrun(REPO / "tests" / "fixtures_distributed.py", "compile_counters", *COMMON, "--data", str(bn_data),
                 "--out", str(out), "--batch-size", "4", "--compile", *fsdp)
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob(f"{mode}.compile.rank*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1], p.stdout[-2000:]
    for r in rows:
        assert r["rc"] == 0 and not r["graph_breaks"], r
        assert r["unique_graphs"] == 1 and r["at_validation"] == [[1, r["frames_ok"]]] * 2, r
    gates = {g["name"]: g for g in json.loads((out / "gates.json").read_text())["results"]}
    assert gates["compiled_vs_eager"]["passed"] and "torch.compile" in gates["compiled_vs_eager"]["detail"]
    want, got = steps(single), steps(out)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    rtol = TOLERANCE["fp32"][0]
    for x, y in zip(got, want):
        for key in ("loss", "val_loss"):
            assert (key in x) == (key in y) and abs(x.get(key, 0) - y.get(key, 0)) <= rtol * abs(y.get(key, 0)), (x, y)
    assert set(ckpt.load(out).weights) == set(ckpt.load(single).weights)  # no _orig_mod. names


def _gloo_unsupported(stderr: str) -> str | None:
    """The exact error when this torch's gloo backend lacks a collective FSDP2 needs."""
    for line in stderr.splitlines():
        if "gloo" in line.lower() and re.search(r"not (supported|implemented)", line, re.I):
            return line.strip()
    return None


def test_fsdp2_matches_single_process_and_resumes(bn_data: Path, single: Path, tmp_path: Path) -> None:
    """FSDP2 stopped at step 4 and resumed follows the single process. The resume runs through
    fixtures_distributed.py's `rank0_reads`: a resume must not need the full state in every rank's
    memory, so rank 0 reads the checkpoint and broadcasts it one tensor at a time, and any other rank
    reading a whole tensor file fails the run (one launch pair for both properties)."""
    out = tmp_path / "fsdp"
    # 2 x grad-accum 2 x 2 ranks: gradient sync only on the last micro-batch (set_requires_gradient_sync)
    args = [*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "2", "--grad-accum", "2", "--fsdp",
            *SAME_VAL_ROWS]
    p = train_dist(*args, "--stop-at", "4", check=False)
    if p.returncode != 0 and (why := _gloo_unsupported(p.stderr)):
        pytest.skip(f"FSDP2 on CPU: this torch's gloo backend lacks a collective: {why}")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "FSDP2" in p.stdout
    # the FSDP2 checkpoint holds full (unsharded) tensors the single-process reader loads
    model, ck = ckpt.load_model(out)
    assert ck.state["step"] == 4 and ck.config.n_layers == 2
    assert set(ck.weights) == set(ckpt.load(single).weights)
    p = torchrun(REPO / "tests" / "fixtures_distributed.py", "rank0_reads", *args)
    assert "resumed from" in p.stdout and "read a whole tensor file" not in p.stderr
    assert_rank0_wrote_once(p, out)
    assert_same_curve(steps(single), steps(out), tol=FSDP_TOL)
    w, ws = ckpt.load(out).weights, ckpt.load(single).weights
    assert max((w[k] - ws[k]).abs().max().item() for k in w) < 1e-3


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_gradient_flow_gate_judges_the_wrapped_model_on_every_rank(bn_data: Path, tmp_path: Path, wrapper) -> None:
    """A fused FFN whose backward returns zeros, planted in the object that trains: every rank's
    gate names exactly its parameters (gathered from FSDP2 shards), and no rank starts training."""
    out = tmp_path / "run"
    extra = ["--fsdp"] if wrapper == "fsdp" else []
    p = torchrun(REPO / "tests" / "gates_runner.py", "zero_grad_ffn", *COMMON, "--data", str(bn_data), "--out",
                 str(out), "--batch-size", "4", *extra, check=False)
    assert p.returncode != 0 and "pre-flight gates failed" in p.stderr, p.stderr[-3000:]
    # each rank stops with its own one-line error (none hangs in a collective waiting for the other)
    assert p.stderr.count("error: pre-flight gates failed") == 2, p.stderr[-3000:]
    flow = next(r for r in json.loads((out / "gates.json").read_text())["results"] if r["name"] == "gradient_flow")
    assert not flow["passed"]
    named = set(re.findall(r"layers\.\d+\.[\w.]+\.weight", flow["detail"]))
    assert named == {"layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
                     "layers.0.feed_forward.w3.weight", "layers.0.ffn_norm.weight"}, flow["detail"]
    assert not (out / "log.jsonl").exists() or not steps(out)
    assert ckpt.latest(out) is None


def test_a_gate_failing_on_one_rank_stops_every_rank(bn_data: Path, tmp_path: Path) -> None:
    """Rank 1 alone fails its overfit gate (stale optimizer): rank 0's gates pass, yet it stops too,
    and gates.json (written by rank 0) says why instead of claiming success."""
    out = tmp_path / "run"
    p = torchrun(REPO / "tests" / "fixtures_distributed.py", *COMMON, "--data", str(bn_data), "--out", str(out),
                 "--batch-size", "4", check=False)
    assert p.returncode != 0
    assert re.search(r"gates FAILED: overfit_one_batch\n", p.stderr), p.stderr[-3000:]  # rank 1's own error
    assert "gates FAILED: all_ranks" in p.stderr and "failed on rank(s) [1]" in p.stderr, p.stderr[-3000:]
    report = json.loads((out / "gates.json").read_text())
    assert not report["passed"] and report["failed"] == ["all_ranks"]
    assert not (out / "log.jsonl").exists() or not steps(out)


def test_sharded_windows_cover_each_window_once_per_epoch(bn_data: Path) -> None:
    stream = TokenStream(bn_data, "train")
    for world, b in ((2, 3), (3, 2)):
        loaders = [WindowLoader(stream, 64, seed=5, rank=r, world_size=world) for r in range(world)]
        n = loaders[0].n_windows
        steps_per_epoch = n // (world * b)
        seen: list[int] = []
        for _ in range(steps_per_epoch):
            for ld in loaders:
                x, _ = ld.next_batch(b)
                # identify each row by content: the windows are what the model actually sees
                seen += [_window_id(stream, row) for row in x]
        assert len(seen) == len(set(seen)), world  # no overlap between ranks, no repeat within the epoch
        assert len(seen) == steps_per_epoch * world * b  # every rank contributed every step
        # no gaps: what the ranks drew together is exactly a prefix of the epoch's permutation
        assert sorted(seen) == sorted(loaders[0].window_index(g) for g in range(len(seen)))
        assert all(ld.consumed == len(seen) for ld in loaders)  # one global position, equal on all ranks


def _window_id(stream: TokenStream, row: torch.Tensor) -> int:
    """The window whose first seq_len tokens are `row` (searched among aligned windows)."""
    cache = _window_id.__dict__.setdefault("cache", {})
    key = id(stream)
    if key not in cache:
        n = (stream.n_tokens - 1) // 64
        cache[key] = {stream.slice(i * 64, 64).tobytes(): i for i in range(n)}
    return cache[key][row.numpy().astype("int64").tobytes()]


def test_fused_adamw_steps_fsdp2_dtensors_like_the_unfused_one() -> None:
    """train.py uses AdamW(fused=True) on CUDA; under FSDP2 it steps DTensor shards. The CPU fused
    kernel goes through the same DTensor dispatch (aten._fused_adamw_), so check it here."""
    p = torchrun(REPO / "tests" / "fixtures_distributed.py", "fused_adamw")
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert r["dtensor_params"]
        assert r["moved"] > 1e-4  # the optimizer did step
        assert r["max_diff"] < 1e-5, r


# ------------------------------------------------------------------- several nodes (HSDP, resume)
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_nodes(script: Path, node_args: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """One torchrun per simulated node (1 CPU rank each), joined by a static rendezvous on localhost:
    what `torchrun --nnodes=N --node-rank=I` does on N machines. `node_args[i]`: node i's arguments."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argvs = [[*TORCHRUN, f"--nnodes={len(node_args)}", f"--node-rank={i}", "--nproc-per-node=1",
              "--master-addr=127.0.0.1", f"--master-port={port}", str(script), *args] for i, args in enumerate(node_args)]
    if not preloaded.preloadable(argvs[0]):  # PRODIP_TEST_COLD=1: every node's torchrun started cold
        procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
                 for a in argvs]
        outs = [p.communicate(timeout=TORCHRUN_TIMEOUT_S) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outs, strict=True)]
    nodes = [preloaded.Forked(a, cwd=REPO, env=env) for a in argvs]  # started together: they rendezvous
    try:
        return [subprocess.CompletedProcess(n.args, n.wait(TORCHRUN_TIMEOUT_S), *n.output()) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait()
            n.close()


def test_mesh_shape_is_hsdp_across_nodes_and_flat_within_one() -> None:
    from training.distributed import mesh_shape

    assert mesh_shape(8, 8) == (8,)  # one node of 8 GPUs: shard over all
    assert mesh_shape(16, 8) == (2, 8)  # two nodes: replicate across them, shard within each
    assert mesh_shape(2, 1) == (2, 1)
    assert mesh_shape(4, 0) == (4,)  # LOCAL_WORLD_SIZE unknown: one node
    assert mesh_shape(6, 4) == (6,)  # uneven nodes (torchrun never makes them): flat


def test_hsdp_on_two_nodes_matches_single_process(bn_data: Path, single: Path, tmp_path: Path) -> None:
    """Two simulated nodes of one rank each: FSDP2 on a 2-D mesh (replicate across nodes, shard within
    one), trained to the same curve as one process with the doubled batch."""
    out = tmp_path / "hsdp"
    args = [*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "4", "--fsdp"]
    node0, node1 = torchrun_nodes(REPO / "training" / "train.py", [args, args])
    if node0.returncode != 0 and (why := _gloo_unsupported(node0.stderr + node1.stderr)):
        pytest.skip(f"HSDP on CPU: this torch's gloo backend lacks a collective: {why}")
    assert node0.returncode == node1.returncode == 0, (node0.stderr[-3000:], node1.stderr[-3000:])
    assert "HSDP 2x1" in node0.stdout and not node1.stdout.strip(), node0.stdout[-2000:]
    assert_same_curve(steps(single), steps(out), tol=FSDP_TOL)


def test_a_node_that_cannot_see_the_run_folder_stops_every_rank(bn_data: Path, tmp_path: Path) -> None:
    """Rank 0 decides what to resume from; a node without the shared file system (its --out is an
    empty local folder, or a stale copy whose checkpoint differs) stops both nodes with one line
    each, before anything is written: no hang, no node 0 resuming while node 1 starts fresh."""
    run = tmp_path / "run"
    base = [*COMMON, "--data", str(bn_data), "--batch-size", "4"]
    train_dist(*base, "--out", str(run), "--stop-at", "2")
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}

    stale = tmp_path / "stale"  # node 1's own copy of the folder, whose checkpoint is not rank 0's
    shutil.copytree(run, stale)
    state = stale / "checkpoints" / ckpt.step_dir_name(2) / ckpt.STATE_FILE
    state.write_text(json.dumps({**json.loads(state.read_text()), "elapsed_s": 12345.0}))
    for other, sees in ((tmp_path / "local", "no checkpoint"), (stale, "checkpoint step 2")):
        t0 = time.monotonic()
        node0, node1 = torchrun_nodes(REPO / "training" / "train.py",
                                      [[*base, "--out", str(run)], [*base, "--out", str(other)]])
        assert node0.returncode != 0 and node1.returncode != 0
        for node in (node0, node1):
            errors = [x for x in node.stderr.splitlines() if x.startswith("error:")]
            assert len(errors) == 1 and "rank(s) [1] do not see the run folder rank 0 sees" in errors[0], node.stderr[-3000:]
            assert "(rank 0: checkpoint step 2 (state.json sha256" in errors[0]
        assert f"this rank (rank 1) sees {sees}" in node1.stderr
        assert time.monotonic() - t0 < TORCHRUN_TIMEOUT_S / 2  # an error, not a collective's timeout
        assert "resumed from" not in node0.stdout
        after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
        assert after == before  # nothing written, nothing removed
    assert not (tmp_path / "local").exists()


def test_fsdp2_in_bf16_gathers_bf16_and_passes_the_gates(bn_data: Path, tmp_path: Path) -> None:
    """--dtype bf16 under FSDP2: MixedPrecisionPolicy (bf16 parameters for the all-gather and compute,
    fp32 gradient reduction); the trained object then differs from the fp32-weight reference by bf16
    rounding, which compiled_vs_eager's measured bf16 tolerance must accept, and the overfit gate
    steps the sharded model itself (no unsharded copy)."""
    from training.gates.model_gates import TOLERANCE

    out = tmp_path / "bf16"
    p = train_dist(*COMMON, "--data", str(bn_data), "--out", str(out), "--batch-size", "4", "--fsdp", "--dtype",
                   "bf16", "--max-steps", "2", check=False)
    if p.returncode != 0 and (why := _gloo_unsupported(p.stderr)):
        pytest.skip(f"FSDP2 on CPU: this torch's gloo backend lacks a collective: {why}")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "bf16 all-gathers and compute, fp32 gradient reduction" in p.stdout
    gates = {r["name"]: r for r in json.loads((out / "gates.json").read_text())["results"]}
    cmp = gates["compiled_vs_eager"]
    assert cmp["passed"] and "FSDP2" in cmp["detail"], cmp
    assert 0 < cmp["value"] <= TOLERANCE["bf16"][1]  # bf16 parameters do differ from the fp32 reference
    assert gates["overfit_one_batch"]["passed"], gates["overfit_one_batch"]
    assert all(math.isfinite(r["loss"]) for r in steps(out) if "loss" in r)

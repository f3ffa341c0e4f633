"""Preemption: real SIGTERM / SIGUSR1 to real training processes (training/loop/preempt_signals.py).

1. One process: SIGTERM mid-run -> the step finishes, a checkpoint of it is written, exit 3 with the
   `preempted at step N by SIGTERM; checkpoint step_N written; …` line; the same command resumes, and
   the per-step losses, grad norms and final weights equal an uninterrupted run's bit for bit.
2. A second signal ends the process at once (killed by it); the newest complete checkpoint loads
   and the same command resumes it to the uninterrupted run's curve. A repeat within the window
   (one request delivered twice, as SLURM + torchrun do) is not a second signal.
3. torchrun, 2 processes on gloo: SIGUSR1 to rank 1 alone -> both ranks stop at the same step, rank 0
   writes that step's checkpoint, each worker exits 3, and the resumed run equals an uninterrupted one.
4. The asynchronous checkpoint writer (training.checkpoint.checkpoint_io.CheckpointWriter): what it writes is the
   state at the save, not later; non-finite state is refused before any copy; a failed write is
   raised at the next save and at the end.
Signals are timed by steps (records in log.jsonl), never by seconds.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import preloaded
import pytest
import torch
from conftest import files_of, stop
from fixtures_reliability import REPO, child_env, train_argv
from safetensors.torch import load_file

from training.checkpoint import checkpoint_io as ckpt
from training.loop.preempt_signals import REPEAT_ENV
from training.model.decoder import Transformer, preset
from training.runfiles import layout
from training.runfiles.cli_harness import EXIT_PREEMPTED
from training.text.tokenizer import Tokenizer

STEPS = 60  # far more than the few the signal needs to land in: the run never finishes first
SIGNAL_AFTER = 3  # step records in log.jsonl before the signal is sent
TIMEOUT_S = 300
POLL_S = 0.002
PREEMPTED = "preempted at step {n} by {sig}; checkpoint {ck} written; run the same command to resume"


def _step_records(run: Path) -> list[dict]:
    f = run / layout.LOG
    if not f.is_file():
        return []
    *lines, _torn = f.read_text(encoding="utf-8").split("\n")  # a line being written is left out
    return [r for r in map(json.loads, lines) if "loss" in r]


def _curve(run: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in _step_records(run)]


def _weights(run: Path) -> dict:
    return load_file(str(ckpt.latest(run) / ckpt.MODEL_FILE))


def _assert_same_run(run: Path, ref: Path) -> None:
    got, want = _curve(run), _curve(ref)
    assert [s for s, _, _ in want] == list(range(1, STEPS + 1))
    assert [s for s, _, _ in got] == list(range(1, STEPS + 1)), "steps lost or repeated in log.jsonl"
    assert got == want, "per-step losses / grad norms differ from the uninterrupted run"
    a, b = _weights(run), _weights(ref)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "final weights differ"
    assert ckpt.step_of(ckpt.latest(run)) == STEPS


def _wait_for(cond, p: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        if p.poll() is not None:
            raise AssertionError(f"the run ended (rc {p.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


@pytest.fixture
def start():
    """start(argv, log, **env): a training process writing to `log`; any still running at the end is killed."""
    started: list[subprocess.Popen] = []

    def go(argv: list[str], log: Path, **env: str) -> subprocess.Popen:
        with open(log, "w") as f:
            started.append(preloaded.popen(argv, cwd=REPO, env={**child_env(), **env}, stdout=f,
                                            stderr=subprocess.STDOUT))
        return started[-1]

    yield go
    for p in started:  # SIGTERM first: torchrun passes it on to its workers, SIGKILL would orphan them
        if p.poll() is None:
            stop(p, timeout=60)


@pytest.fixture(scope="module")
def reference(bn_data, tmp_path_factory) -> Path:
    """The uninterrupted run: STEPS steps, one checkpoint, at the end."""
    out = tmp_path_factory.mktemp("preempt-ref") / "run"
    r = preloaded.run(train_argv(bn_data, out, steps=STEPS, save_every=0), cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


def test_sigterm_checkpoints_the_step_and_resumes_exactly(bn_data, reference, tmp_path, start):
    run = tmp_path / "run"
    argv = train_argv(bn_data, run, steps=STEPS, save_every=0)  # no checkpoint but the one the signal asks for
    p = start(argv, tmp_path / "first.log")
    _wait_for(lambda: len(_step_records(run)) >= SIGNAL_AFTER, p, f"{SIGNAL_AFTER} steps")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=TIMEOUT_S) == EXIT_PREEMPTED
    out = (tmp_path / "first.log").read_text()
    assert "Traceback" not in out, out
    n = ckpt.step_of(ckpt.latest(run))
    assert SIGNAL_AFTER <= n < STEPS, out
    assert PREEMPTED.format(n=n, sig="SIGTERM", ck=ckpt.step_dir_name(n)) in out, out
    assert [ckpt.step_of(c) for c in ckpt.list_checkpoints(run)] == [n]  # the signal's checkpoint, and only it
    assert [r["step"] for r in _step_records(run)] == list(range(1, n + 1)), "the signal's step is not the last one"
    events = [json.loads(x) for x in (run / layout.LOG).read_text().splitlines() if '"event"' in x]
    assert {"event": "preempted", "step": n, "signal": "SIGTERM"} in events
    assert not list((run / layout.CHECKPOINTS).glob(ckpt.TMP_PREFIX + "*"))

    r = preloaded.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"resumed from {run / layout.CHECKPOINTS / ckpt.step_dir_name(n)} (step {n}," in r.stdout, r.stdout
    _assert_same_run(run, reference)


def _stopped(pid: int) -> bool:
    """Every thread of the process is stopped (SIGSTOP took effect): state T in /proc."""
    try:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:  # a thread that ended while it was read: look again
        return False
    return bool(states) and all(s in "tT" for s in states)


def test_second_signal_exits_at_once_and_the_newest_checkpoint_loads(bn_data, reference, tmp_path, start):
    """At once, as an event rather than a time: the process is frozen (SIGSTOP) while its files are read,
    gets the second SIGTERM and dies of it without writing one more byte (no step record, no checkpoint)."""
    run = tmp_path / "run"
    argv = train_argv(bn_data, run, steps=STEPS, save_every=1)  # a save every step: the second signal lands near one
    log = tmp_path / "first.log"
    # no repeat window: the step and the save of this tiny model take milliseconds, less than the window
    p = start(argv, log, **{REPEAT_ENV: "0"})
    _wait_for(lambda: len(_step_records(run)) >= SIGNAL_AFTER, p, f"{SIGNAL_AFTER} steps")
    p.send_signal(signal.SIGTERM)
    _wait_for(lambda: "SIGTERM received" in log.read_text(), p, "the first signal's handler")
    p.send_signal(signal.SIGSTOP)
    _wait_for(lambda: _stopped(p.pid), p, "SIGSTOP to take effect")
    frozen = files_of(run)
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGCONT)
    assert p.wait(timeout=TIMEOUT_S) == -signal.SIGTERM, log.read_text()  # killed by it, not a clean exit
    assert files_of(run) == frozen, "the run wrote on after the second signal"
    assert "preempted at step" not in log.read_text()
    newest = ckpt.latest(run)
    ck = ckpt.load(run)  # complete and loadable, with everything a resume needs
    assert ck.state["step"] == ckpt.step_of(newest) >= 1
    ckpt.read_state(newest, ckpt.RESUME_STATE_SCHEMA)
    assert ck.optimizer_and_rng(strict=True)[0]

    r = preloaded.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not list((run / layout.CHECKPOINTS).glob(ckpt.TMP_PREFIX + "*"))
    _assert_same_run(run, reference)


REPEAT_SCRIPT = """
import os, signal, sys, time
import torch
from training.distributed import Dist
from training.loop.preempt_signals import Preemption
p = Preemption(Dist(), torch.device("cpu")).install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)  # the handler has run
os.kill(os.getpid(), signal.SIGTERM)  # the same request delivered again, within the window: ignored
time.sleep(0.05)
print("alive, stopping on", p.poll(), flush=True)
time.sleep(p.repeat_after_s)
os.kill(os.getpid(), signal.SIGUSR1)  # a second request
time.sleep(30)
print("still alive", flush=True)
"""


def test_a_repeat_within_the_window_is_one_request_a_later_one_kills():
    r = subprocess.run([sys.executable, "-c", REPEAT_SCRIPT], cwd=REPO, env={**child_env(), REPEAT_ENV: "0.5"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGUSR1, r.stdout + r.stderr
    assert r.stdout == f"alive, stopping on {int(signal.SIGTERM)}\n", r.stdout + r.stderr
    assert r.stderr.count("SIGTERM received") == 1 and "second SIGUSR1: exiting at once" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------- torchrun
def _torchrun_argv(data: Path, out: Path, forked: bool = False) -> list[str]:
    """torchrun over train.py; `forked`: its workers forked from the preloaded interpreter (tests/torchrun_forked.py)
    for the runs that are not signalled: a signalled run's workers are found through /proc (_workers), which shows
    a forked worker's initial environment, not its RANK."""
    argv = train_argv(data, out, "--device", "cpu", steps=STEPS, save_every=0)
    assert argv[1] == str(REPO / "training" / "train.py")
    launcher = [str(REPO / "tests" / "torchrun_forked.py")] if forked else ["-m", "torch.distributed.run"]
    return [sys.executable, *launcher, "--standalone", "--nproc_per_node=2", *argv[1:]]


def _workers(pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun `pid`'s worker processes (its children with RANK in their environment)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0") if ppid == pid else []
        except (OSError, IndexError, ValueError):
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                found[int(kv[5:])] = int(d.name)
    return found


def _torchrun(argv: list[str]) -> subprocess.CompletedProcess:
    return preloaded.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def torchrun_reference(bn_data, tmp_path_factory):
    """The uninterrupted torchrun run both torchrun tests compare with: started by the first test that
    asks, alongside its signalled run (it needs no signal); calling the fixture's value waits for it."""
    out = tmp_path_factory.mktemp("preempt-torchrun-ref") / "run"
    log = out.parent / "ref.log"
    with open(log, "w") as f:
        p = preloaded.popen(_torchrun_argv(bn_data, out, forked=True), cwd=REPO, env=child_env(), stdout=f,
                            stderr=subprocess.STDOUT)

    def finished() -> Path:
        assert p.wait(timeout=TIMEOUT_S) == 0, log.read_text()[-3000:]
        return out

    yield finished
    if p.poll() is None:
        stop(p, timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers through /proc")
@pytest.mark.parametrize("to", ["rank1", "agent"])
def test_torchrun_one_rank_signalled_all_ranks_stop_at_the_same_step(bn_data, tmp_path, start, to,
                                                                     torchrun_reference):
    """`rank1`: SIGUSR1 to rank 1 alone (SLURM's --signal reaches the workers): rank 0 learns it through the
    step's all-reduce. `agent`: SIGTERM to torchrun itself, as a cloud provider or Kubernetes sends it: the
    agent forwards it to every worker and SIGKILLs them --shutdown-timeout later. Either way both ranks
    stop after the same step, rank 0 writes its checkpoint, and the resumed run equals an uninterrupted one."""
    sig = "SIGUSR1" if to == "rank1" else "SIGTERM"
    run = tmp_path / "run"
    argv = _torchrun_argv(bn_data, run)
    log = tmp_path / "first.log"
    p = start(argv, log)
    _wait_for(lambda: len(_step_records(run)) >= SIGNAL_AFTER, p, f"{SIGNAL_AFTER} steps")
    workers = _workers(p.pid)
    assert sorted(workers) == [0, 1], workers
    if to == "rank1":
        os.kill(workers[1], signal.SIGUSR1)  # rank 1 alone: rank 0 must learn it and stop at the same step
    else:
        p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=TIMEOUT_S) != 0  # torchrun reports a worker that exited non-zero as a failure (1)
    ref = torchrun_reference()
    out = log.read_text()
    n = ckpt.step_of(ckpt.latest(run))
    assert SIGNAL_AFTER <= n < STEPS, out
    assert out.count(PREEMPTED.format(n=n, sig=sig, ck=ckpt.step_dir_name(n))) == 1, out  # rank 0's line
    if to == "rank1":
        assert "rank 1: SIGUSR1 received" in out and "rank 0: SIGUSR1 received" not in out, out
        assert out.count(f"exitcode  : {EXIT_PREEMPTED} ") == 2, out  # both workers, also the one torchrun SIGTERMed
    assert "training/trainer.py" not in out, out  # no worker traceback (torchrun prints one of its own)
    assert [r["step"] for r in _step_records(run)] == list(range(1, n + 1))
    assert [ckpt.step_of(c) for c in ckpt.list_checkpoints(run)] == [n]

    r = _torchrun(_torchrun_argv(bn_data, run, forked=True))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"(step {n}," in r.stdout and "resumed from" in r.stdout, r.stdout[-2000:]
    _assert_same_run(run, ref)


# ------------------------------------------------------------------------------- asynchronous writer
@pytest.fixture
def tiny_state(bn_data):
    tok = Tokenizer.load(bn_data / layout.TOKENIZER)
    cfg = preset("tiny", vocab_size=tok.vocab_size, n_layers=1)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, cfg.vocab_size, (1, 8)), torch.randint(0, cfg.vocab_size, (1, 8)))[1].backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    moments, groups = ckpt.flatten_optimizer(opt.state_dict(), names)
    return model, cfg, tok, moments, groups


def _save(writer, run, step, model, cfg, tok, moments, groups):
    writer.save(run, step, weights=ckpt.drop_tied(model.state_dict(), cfg), cfg=cfg, tokenizer=tok,
                optim_tensors=moments, rng={"torch_cpu": torch.get_rng_state()},
                state={"tokens": step, "data": {}, "optimizer_param_groups": groups})


def test_async_writer_writes_the_state_at_the_save_not_later(tiny_state, tmp_path):
    model, cfg, tok, moments, groups = tiny_state
    before = {k: v.clone() for k, v in model.state_dict().items()}
    w = ckpt.CheckpointWriter(asynchronous=True)
    _save(w, tmp_path, 1, model, cfg, tok, moments, groups)
    with torch.no_grad():  # training goes on while the thread writes: it must not see this
        for p in model.parameters():
            p.add_(1.0)
        for t in moments.values():
            t.add_(1.0)
    w.close()
    got = ckpt.load(tmp_path)
    assert all(torch.equal(got.weights[k], before[k]) for k in got.weights)
    assert not torch.equal(got.weights["norm.weight"], model.state_dict()["norm.weight"])
    saved, _ = got.optimizer_and_rng(strict=True)
    assert all(torch.equal(saved[k] + 1.0, moments[k]) for k in saved if not k.endswith("/step"))
    assert len(w.stall_s) == len(w.write_s) == 1



def test_fresh_gathered_state_is_written_as_of_the_save_even_its_step_counters(tiny_state, tmp_path):
    """FSDP2's gathered state (`fresh=True`) is written without another copy, but get_optimizer_state_dict
    hands back the optimizer's non-DTensor entries (AdamW's 0-dim `step`) as the live tensors: the
    optimizer's next step increments them in place. Caught in CI as a step-4 checkpoint whose counters
    said 5; here the write is held behind a gate until the live tensors have moved on."""
    import threading

    model, cfg, tok, moments, groups = tiny_state
    fresh = {k: v.clone() for k, v in moments.items()}  # the gathered copies...
    steps = [k for k, v in fresh.items() if v.dim() == 0]
    assert steps, sorted(fresh)[:4]  # the tiny state holds AdamW step counters to alias
    live = {k: torch.tensor(4.0) for k in steps}
    fresh.update(live)  # ...except the counters: the optimizer's own tensors
    w = ckpt.CheckpointWriter(asynchronous=True)
    gate = threading.Event()
    w._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    w._pool.submit(gate.wait)  # the writer thread is busy until the training below has moved on
    w.save(tmp_path, 1, weights=ckpt.drop_tied(model.state_dict(), cfg), cfg=cfg, tokenizer=tok,
           optim_tensors=fresh, rng={"torch_cpu": torch.get_rng_state()},
           state={"tokens": 1, "data": {}, "optimizer_param_groups": groups}, fresh=True)
    for v in live.values():  # the next optimizer step
        v.add_(1.0)
    gate.set()
    w.close()
    saved, _ = ckpt.load(tmp_path).optimizer_and_rng(strict=True)
    assert all(saved[k].item() == 4.0 for k in steps), {k: saved[k].item() for k in steps}

def test_nonfinite_state_is_refused_before_any_copy(tiny_state, tmp_path):
    model, cfg, tok, moments, groups = tiny_state
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    w = ckpt.CheckpointWriter(asynchronous=True)
    with pytest.raises(ckpt.CheckpointError, match=r"refusing to save weights: norm\.weight holds non-finite"):
        _save(w, tmp_path, 1, model, cfg, tok, moments, groups)
    w.close()
    assert not (tmp_path / layout.CHECKPOINTS).exists() and not w._buffers


def test_nonfinite_names_exactly_the_tensors_holding_nan_or_inf():
    """The finite check sums each tensor first (fast), so its two traps are pinned: a NaN/inf anywhere
    (first, middle, last element; fp32, bf16, fp16) is found, and finite values whose sum overflows
    (3e38 + 3e38 in fp32, 6e4 + 6e4 in fp16) are not called non-finite."""
    ok = {"big32": torch.full((4,), 3e38), "big16": torch.full((3,), 6e4, dtype=torch.float16),
          "empty": torch.zeros(0), "ints": torch.arange(5), "plain": torch.randn(1000)}
    assert ckpt.nonfinite(ok) == []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bad in (float("nan"), float("inf"), float("-inf")):
            for pos in (0, 517, 999):
                t = torch.randn(1000).to(dtype)
                t[pos] = bad
                assert ckpt.nonfinite({**ok, "x": t}) == ["x"], (dtype, bad, pos)
    opposite = torch.randn(10)
    opposite[2], opposite[7] = float("inf"), float("-inf")  # the sum is NaN, not inf
    assert ckpt.nonfinite({"y": opposite}) == ["y"]


def test_a_failed_background_write_is_raised_at_the_next_save_and_at_the_end(tiny_state, tmp_path):
    model, cfg, tok, moments, groups = tiny_state
    (tmp_path / layout.CHECKPOINTS).write_text("a file where the checkpoints folder should be")
    w = ckpt.CheckpointWriter(asynchronous=True)
    _save(w, tmp_path, 1, model, cfg, tok, moments, groups)  # returns: the write fails in the thread
    with pytest.raises(ckpt.CheckpointError, match="could not write checkpoint 1"):
        _save(w, tmp_path, 2, model, cfg, tok, moments, groups)
    _save(w, tmp_path, 3, model, cfg, tok, moments, groups)
    with pytest.raises(ckpt.CheckpointError, match="could not write checkpoint 3"):
        w.close()

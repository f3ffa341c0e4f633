"""The preemption save of a real-size model under torchrun: does it land inside the grace period?

    python tests/benchmarks/bench_preempt.py --preset 400m --out /tmp/bench-preempt

Trains `--preset` (fp32, CPU, gloo) with `training/train.py` as a user runs it, once per launch
(one process; `torchrun` with 2 workers under DDP; the same under FSDP2, where every rank writes
its own shards; and FSDP2 with `--no-fsdp-sharded-checkpoints`, whose save gathers every shard to
rank 0 first: the peer the sharded save replaces), waits for the first optimizer step in log.jsonl, then sends SIGTERM to the
launcher only, as a provider or Kubernetes does (torchrun's agent forwards it to its workers). It
measures signal → exit and reads the run's own record of the save (`{"event": "checkpoint"}`:
stall_ms, write_s, bytes). torchrun SIGKILLs workers `--shutdown-timeout` seconds (default
SHUTDOWN_TIMEOUT_S) after forwarding the signal: a save that does not land by then leaves no
checkpoint. Where torchrun has --shutdown-timeout this benchmark gives it MEASURE_TIMEOUT_S, so the
save is measured whatever it takes, and the table says whether it would have landed inside the
default; the newest checkpoint is loaded to prove it was written.

The checkpoint's bytes scale with the parameter count (fp32 weights + two AdamW moments), so the
`1b` column projects the save (stall + write) by that ratio. The model's vocabulary comes from the data:
the shipped corpus is prepared with --vocab-size (default 8192) unless --data names a prepared
folder, so the parameter count printed is the one measured. A CPU gather over gloo and a CPU disk
are slower than NVLink and a GPU machine's NVMe: read the figures as an upper bound for one node.
Writes preempt.json and preempt.md to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

SHUTDOWN_TIMEOUT_S = 30  # torchrun's default --shutdown-timeout (torch.distributed.elastic agent)
CORPUS = REPO / "training" / "assets" / "corpus"
LAUNCHES = ("single", "ddp", "fsdp", "fsdp-gather")
MEASURE_TIMEOUT_S = 900  # the grace this benchmark gives torchrun where it can (--shutdown-timeout)
STEP_WAIT_S = 900.0  # how long the first optimizer step may take (a 400m model on 2 shared CPU cores)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tests/benchmarks/bench_preempt.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="400m", help="model preset to train (default 400m)")
    p.add_argument("--data", type=Path, help="a prepared data folder (default: the shipped corpus, prepared here)")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary when preparing the shipped corpus")
    p.add_argument("--launch", action="append", choices=LAUNCHES, help=f"which launches (default: all of {LAUNCHES})")
    p.add_argument("--out", type=Path, required=True, help="folder for preempt.json and preempt.md")
    p.add_argument("--force", action="store_true", help="overwrite an existing report in --out")
    return p


def launch_cmd(kind: str, preset: str, data: Path, out: Path) -> list[str]:
    train = [str(REPO / "training" / "train.py"), "--preset", preset, "--data", str(data), "--out", str(out),
             "--dtype", "fp32", "--no-compile", "--batch-size", "1", "--grad-accum", "1", "--seq-len", "32",
             "--max-steps", "1000", "--warmup-steps", "1", "--eval-every", "0", "--save-every", "0",
             "--log-every", "1", *[x for g in ("gradient_flow", "compiled_vs_eager", "overfit_one_batch",
                                               "throughput", "frozen_parameters") for x in ("--skip-gate", g)]]
    if kind == "single":
        return [sys.executable, *train]
    fsdp = {"fsdp": ["--fsdp"], "fsdp-gather": ["--fsdp", "--no-fsdp-sharded-checkpoints"]}.get(kind, [])
    # a long grace period, so the save is measured whatever it takes; the table compares it with the default
    grace = ["--shutdown-timeout", str(MEASURE_TIMEOUT_S)] if torchrun_has_shutdown_timeout() else []
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
            *grace, *train, *fsdp]


def torchrun_has_shutdown_timeout() -> bool:
    """torchrun's --shutdown-timeout (torch 2.12+; older releases hard-code SHUTDOWN_TIMEOUT_S)."""
    from torch.distributed import run

    return "--shutdown-timeout" in run.get_args_parser().format_help()


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(run: Path) -> list[dict]:
    f = run / "log.jsonl"
    if not f.is_file():
        return []
    out = []
    for line in f.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # the line being written
            out.append(json.loads(line))
    return out


def one(kind: str, preset: str, data: Path, tmp: Path) -> dict:
    from training.checkpoint import checkpoint_io as ckpt

    run = tmp / kind
    env = {**os.environ, "OMP_NUM_THREADS": "1" if kind != "single" else "2"}
    t_start = time.perf_counter()
    p = subprocess.Popen(launch_cmd(kind, preset, data, run), cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + STEP_WAIT_S
    while not any("loss" in r for r in records(run)):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise SystemExit(f"error: {kind}: no optimizer step logged (exit {p.poll()}):\n{p.stdout.read()[-3000:]}")
        time.sleep(0.2)
    first_step_s = time.perf_counter() - t_start
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)  # the launcher only: torchrun's agent forwards it to the workers
    output, _ = p.communicate(timeout=600)
    exit_s = time.perf_counter() - t0
    events = records(run)
    saved = [r for r in events if r.get("event") == "checkpoint"]
    latest = ckpt.latest(run)
    loaded = False
    if latest is not None:
        ckpt.load(latest)  # the weights read back and checked against the config
        loaded = True
    n_params = sum(t.numel() for t in ckpt.load(latest).weights.values()) if loaded else 0
    rec = saved[-1] if saved else {}
    return {"launch": kind, "exit_code": p.returncode, "first_step_s": round(first_step_s, 1),
            "signal_to_exit_s": round(exit_s, 2), "stall_ms": rec.get("stall_ms"), "write_s": rec.get("write_s"),
            "async": rec.get("async", True), "sharded": rec.get("sharded", False),
            "bytes": rec.get("bytes"), "params": n_params, "checkpoint": str(latest) if latest else None,
            "loaded": loaded, "preempted_logged": any(r.get("event") == "preempted" for r in events),
            "within_grace": loaded and exit_s < SHUTDOWN_TIMEOUT_S, "tail": output[-600:]}


def save_s(r: dict) -> float:
    """The save's own seconds: the training thread's part (finite check, gather, copy) and, for an
    asynchronous save, the background write (a synchronous save's stall already holds its write)."""
    return (r["stall_ms"] or 0) / 1e3 + ((r["write_s"] or 0) if r.get("async", True) else 0.0)


def markdown(rows: list[dict], ratio: float, preset: str) -> str:
    lines = [f"# Preemption save: `{preset}` on CPU (fp32, gloo), SIGTERM to the launcher", "",
             f"torchrun's default --shutdown-timeout: {SHUTDOWN_TIMEOUT_S} s. Signal → exit includes finishing the "
             f"CPU step in progress. `1b` save projected by the parameter ratio {ratio:.2f}.", "",
             "| launch | params | checkpoint | stall (training thread) | write | save | signal → exit | checkpoint "
             "loads | inside 30 s | 1b save, projected |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gb = (r["bytes"] or 0) / 1e9
        lines.append(f"| {r['launch']} | {r['params'] / 1e6:,.0f} M | {gb:.2f} GB | {r['stall_ms'] or 0:,.0f} ms | "
                     f"{r['write_s'] or 0:.2f} s | {save_s(r):.1f} s | {r['signal_to_exit_s']:.1f} s | "
                     f"{'yes' if r['loaded'] else 'NO'} | {'yes' if r['within_grace'] else 'NO'} | "
                     f"{save_s(r) * ratio:.1f} s |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    outputs = [a.out / "preempt.json", a.out / "preempt.md"]
    if not a.force and any(p.exists() for p in outputs):
        print(f"error: --out {a.out} already holds a report; use --force to overwrite", file=sys.stderr)
        return 2
    from training.model.decoder import count_params, preset

    with tempfile.TemporaryDirectory(prefix="prodip-preempt-") as tmp:
        data = a.data
        if data is None:
            from training.prepare import prepare

            data = Path(tmp) / "data"
            print(f"preparing {CORPUS} at vocab {a.vocab_size} ...", flush=True)
            prepare([CORPUS], data, vocab_size=a.vocab_size, progress=False, workers=1, fertility_floor=1.5)
        rows = []
        for kind in a.launch or LAUNCHES:
            print(f"{kind}: training {a.preset}, SIGTERM after the first step ...", flush=True)
            rows.append(one(kind, a.preset, data, Path(tmp)))
            print(f"  signal -> exit {rows[-1]['signal_to_exit_s']} s, checkpoint loads: {rows[-1]['loaded']}", flush=True)
    ratio = count_params(preset("1b")) / count_params(preset(a.preset))
    a.out.mkdir(parents=True, exist_ok=True)
    outputs[0].write_text(json.dumps({"preset": a.preset, "shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
                                      "ratio_1b": ratio, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    outputs[1].write_text(markdown(rows, ratio, a.preset), encoding="utf-8")
    print(markdown(rows, ratio, a.preset))
    print(f"wrote {outputs[0]} and {outputs[1]}")
    return 0 if all(r["loaded"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

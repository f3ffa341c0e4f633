"""tests/preloaded.py (CLI runs forked from a preloaded interpreter) against its oracle: the same argv
run by a cold `python`, as a user runs it. Whatever the suite learns through a forked run must be what
a cold run would have shown."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import preloaded
from fixtures_reliability import child_env, train_argv
from safetensors.torch import load_file

from training.checkpoint import checkpoint_io as ckpt

PROBE = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    import torch
    atexit.register(lambda: print("atexit ran"))
    def late():
        time.sleep(0.2)
        print("non-daemon thread finished")
    threading.Thread(target=late).start()
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                      "env": os.environ.get("PROBE_VAR"), "stdin": sys.stdin.read(),
                      "threads": torch.get_num_threads(), "stdout_encoding": sys.stdout.encoding}))
    print("to stderr: ক", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise ValueError("boom")
    sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
""")


def both(argv: list[str], **kw) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    n = preloaded.forked_runs
    forked = preloaded.run(argv, capture_output=True, text=True, **kw)
    assert preloaded.forked_runs == n + 1, "not forked: the comparison would be cold against cold"
    cold = subprocess.run(argv, capture_output=True, text=True, **kw)
    return forked, cold


def test_a_forked_cli_is_set_up_as_a_cold_interpreter_would_be(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE, encoding="utf-8")
    env = {**child_env(threads=1), "PROBE_VAR": "বাংলা"}
    for arg, want_rc in (("0", 0), ("7", 7), ("raise", 1), ("a message", 1)):
        argv = [sys.executable, str(script), arg]
        assert preloaded.preloadable(argv)
        forked, cold = both(argv, cwd=tmp_path, env=env, input="from stdin\n", timeout=120)
        assert (forked.returncode, cold.returncode) == (want_rc, want_rc), (forked, cold)
        assert forked.stdout == cold.stdout, (forked.stdout, cold.stdout)
        assert json.loads(forked.stdout.splitlines()[0]) == {
            "argv": [str(script), arg], "path0": str(tmp_path), "cwd": str(tmp_path), "name": "__main__",
            "env": "বাংলা", "stdin": "from stdin\n", "threads": 1, "stdout_encoding": "utf-8"}
        assert forked.stdout.splitlines()[1:] == ["non-daemon thread finished", "atexit ran"]
        # a traceback names this file's lines the same way; only the runner's own frames may differ
        assert forked.stderr.splitlines()[0] == cold.stderr.splitlines()[0] == "to stderr: ক"
        assert forked.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1], (forked.stderr, cold.stderr)


def test_a_module_the_server_imported_runs_without_runpy_s_warning():
    """`python -m export --help`: the server preloaded export.__main__; a cold run has no warning, nor may this."""
    forked, cold = both([sys.executable, "-m", "export", "--help"], cwd=preloaded.REPO, timeout=120)
    assert forked.returncode == cold.returncode == 0
    assert (forked.stdout, forked.stderr) == (cold.stdout, cold.stderr) and cold.stderr == ""


def test_a_forked_cli_takes_signals_and_timeouts_as_a_process(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    p = preloaded.Forked([sys.executable, str(script)], cwd=tmp_path, env=child_env())
    deadline = time.monotonic() + 60
    while "up" not in p.output()[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM  # as subprocess reports a process killed by a signal
    p.close()
    try:
        preloaded.run([sys.executable, str(script)], cwd=tmp_path, timeout=1, capture_output=True)
        raise AssertionError("no timeout")
    except subprocess.TimeoutExpired as e:
        assert e.timeout == 1


def test_a_forked_training_run_equals_a_cold_one(bn_data, tmp_path):
    """The suite's main use: `python training/train.py` forked trains the very same steps and weights."""
    runs = {}
    for how in ("forked", "cold"):
        out = tmp_path / how
        argv = train_argv(bn_data, out, steps=4, save_every=2)
        run = preloaded.run if how == "forked" else subprocess.run
        n = preloaded.forked_runs
        p = run(argv, env=child_env(), capture_output=True, text=True, timeout=300)
        assert preloaded.forked_runs == n + (how == "forked")
        assert p.returncode == 0, p.stderr[-3000:]
        runs[how] = out
    losses = {how: [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
                    if r.get("event", "step") == "step" and "loss" in r] for how, out in runs.items()}
    assert len(losses["cold"]) == 4 and losses["forked"] == losses["cold"]
    a = load_file(str(ckpt.latest(runs["forked"]) / ckpt.MODEL_FILE))
    b = load_file(str(ckpt.latest(runs["cold"]) / ckpt.MODEL_FILE))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


WORKER_PROBE = textwrap.dedent("""
    import json, os, sys
    print(json.dumps({"rank": int(os.environ["RANK"]), "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                      "name": __name__, "env": os.environ.get("PROBE_VAR"), "own_session": os.getsid(0) == os.getpid(),
                      "parent": os.getppid(), "unbuffered": not sys.stdout.line_buffering}))
    sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
""")


def test_torchrun_workers_forked_by_torchrun_forked_are_set_up_as_torchrun_starts_them(tmp_path):
    """tests/torchrun_forked.py (the distributed tests' torchrun) against `python -m torch.distributed.run`:
    each worker sees the same argv, sys.path[0], folder, environment and `__main__`, runs in its own session
    as the agent's child, and the agent reports a worker's exit status as it reports a cold worker's."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER_PROBE, encoding="utf-8")
    env = {**child_env(threads=1), "PROBE_VAR": "বাংলা"}
    args = ["--standalone", "--nproc_per_node=2", str(script)]
    for code in ("0", "3"):
        launched = {"forked": preloaded.Forked([sys.executable, str(preloaded.REPO / "tests" / "torchrun_forked.py"),
                                                *args, code], cwd=tmp_path, env=env),
                    "cold": subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, code], cwd=tmp_path,
                                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)}
        seen = {}
        for how, p in launched.items():
            rc = p.wait(timeout=120)
            out, err = p.output() if how == "forked" else p.communicate()
            rows = sorted((json.loads(x) for x in out.splitlines() if x.startswith("{")), key=lambda r: r["rank"])
            assert [r["rank"] for r in rows] == [0, 1] and all(r.pop("parent") == p.pid for r in rows), (how, out, err)
            seen[how] = (rc, rows, f"exitcode  : {code}" in err)
            if how == "forked":
                p.close()
        assert seen["forked"] == seen["cold"], seen
        rc, rows, reported = seen["cold"]
        assert rc == (code != "0") and reported == (code != "0"), seen
        assert rows[0] == {"rank": 0, "argv": [str(script), code], "path0": str(tmp_path), "cwd": str(tmp_path),
                           "name": "__main__", "env": "বাংলা", "own_session": True, "unbuffered": True}, rows

"""A run that lives in object storage (training/store/remote_run.py, training/mirror/run_mirror.py, docs/rented.md).

Every test talks to a real S3-compatible server on 127.0.0.1 (moto's server mode, tests/fixtures_remote.py)
through real s3fs clients, and runs training/train.py as a user does:

1. kill -9 while a checkpoint is being uploaded (the server holds one of its files in flight), then
   the same command on an EMPTY local cache: it pulls the newest committed checkpoint, names the
   partial one in a warning, and the per-step losses equal an uninterrupted local run's bit for bit.
2. SIGTERM: the step's checkpoint is uploaded and committed before the process exits 3; the same
   command on a new cache resumes from it.
3. The server stops mid-run: training goes on locally, one warning line, uploads retried with
   back-off; once it is back the run catches up and ends on a committed checkpoint.
4. A store unreachable for the whole run: the run trains locally, says so at the end and exits
   non-zero, unless --allow-local-only.
5. Bad input: an unknown scheme, a missing bucket, missing credentials, a URL holding another run or
   someone else's objects, s3fs not installed: one `error:` line each, nothing written anywhere.
6. --data as a URL, for train.py and for SFT (training/store/remote_data.py): pulled once, checked, reused.
Exports and serving from a URL: tests/test_remote_export.py. Credentials never appear in any output or in any file written locally or remotely.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import moto  # noqa: F401  (dev dependencies, as s3fs: absent, this module fails, never skips)
import preloaded
import pytest
import s3fs  # noqa: F401
import torch
from conftest import stop
from fixtures_reliability import REPO, SHRINK, call_main, child_env, one_error, train_argv, tree_digest
from fixtures_remote import TIMEOUT_S, bucket, committed_steps, no_secret, remote_argv, remote_env
from safetensors.torch import load_file

from training.runfiles import layout
from training.runfiles.cli_harness import EXIT_PREEMPTED

POLL_S = 0.01
STEPS, EVERY = 8, 2
FAST_RETRY = {"PRODIP_MIRROR_BACKOFF_MAX_S": "0.5"}


def _curve(log: str) -> list[tuple[int, float, float]]:
    recs = [json.loads(line) for line in log.splitlines() if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r and "step" in r]


@pytest.fixture(scope="module")
def reference(bn_data, tmp_path_factory) -> Path:
    """The uninterrupted local run the remote runs must equal."""
    out = tmp_path_factory.mktemp("remote-ref") / "run"
    r = preloaded.run(train_argv(bn_data, out, steps=STEPS, save_every=EVERY), cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


def _wait(cond, p: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        if p.poll() is not None:
            raise AssertionError(f"the run ended (rc {p.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S)


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as f:
        return preloaded.popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def test_kill9_mid_upload_then_resume_on_an_empty_cache_is_bit_exact(bn_data, reference, s3_server, tmp_path):
    fs, url = s3_server.fs(), f"s3://{bucket(s3_server, 'kill9')}/runs/r1"
    s3_server.hold = "r1/checkpoints/step_0000006/optim.safetensors"  # config + weights up, this one in flight
    s3_server.held.clear()
    p = _start(remote_argv(bn_data, url, tmp_path / "cache1"), tmp_path / "first.log", remote_env(s3_server))
    try:
        _wait(s3_server.held.is_set, p, "the upload of step 6")
        p.kill()  # SIGKILL, mid-upload
        p.wait(timeout=60)
    finally:
        s3_server.hold = ""
        s3_server.release.set()  # the held request fails: the file never lands
    time.sleep(0.2)
    s3_server.release.clear()
    assert committed_steps(fs, "kill9/runs/r1") == [2, 4]
    assert fs.exists("kill9/runs/r1/checkpoints/step_0000006/model.safetensors")  # a partial upload is there

    r = preloaded.run(remote_argv(bn_data, url, tmp_path / "cache2"), cwd=REPO, env=remote_env(s3_server),
                       capture_output=True, text=True, timeout=TIMEOUT_S)  # a new machine: an empty cache
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoints/step_0000006 is incomplete" in r.stdout and "ignored" in r.stdout, r.stdout
    assert "resumed from" in r.stdout and "(step 4," in r.stdout, r.stdout
    want = _curve((reference / layout.LOG).read_text())
    assert [s for s, _, _ in want] == list(range(1, STEPS + 1))
    assert _curve((tmp_path / "cache2" / layout.LOG).read_text()) == want, "per-step losses differ"
    assert _curve(fs.cat_file("kill9/runs/r1/log.jsonl").decode()) == want, "the mirrored log differs"
    assert committed_steps(fs, "kill9/runs/r1") == [4, 6, 8]  # --keep-last 3 pruned the store too
    remote_w = tmp_path / "w.safetensors"
    fs.get_file("kill9/runs/r1/checkpoints/step_0000008/model.safetensors", str(remote_w))
    a, b = load_file(str(remote_w)), load_file(str(reference / "checkpoints/step_0000008/model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "final weights differ"
    no_secret(r.stdout, r.stderr, (tmp_path / "first.log").read_text(), roots=(tmp_path / "cache2",), fs=fs,
               remote_root="kill9")


def test_sigterm_commits_the_checkpoint_before_exit_and_a_new_machine_resumes(bn_data, s3_server, tmp_path):
    fs, url = s3_server.fs(), f"s3://{bucket(s3_server, 'sigterm')}/run"
    steps = 40
    argv = remote_argv(bn_data, url, tmp_path / "cache1", steps=steps, save_every=0)  # only the signal's checkpoint
    p = _start(argv, tmp_path / "first.log", remote_env(s3_server))
    try:
        log = tmp_path / "cache1" / layout.LOG
        _wait(lambda: log.is_file() and len(_curve(log.read_text())) >= 3, p, "3 steps")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=TIMEOUT_S) == EXIT_PREEMPTED
    finally:
        if p.poll() is None:
            stop(p)
    out = (tmp_path / "first.log").read_text()
    n = int(out.split("preempted at step ")[1].split()[0])
    assert 3 <= n < steps and "Traceback" not in out, out
    assert committed_steps(fs, "sigterm/run") == [n], out  # uploaded and committed before the process exited
    r = preloaded.run(remote_argv(bn_data, url, tmp_path / "cache2", steps=n + 2, save_every=0), cwd=REPO,
                       env=remote_env(s3_server), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"(step {n}," in r.stdout and committed_steps(fs, "sigterm/run") == [n, n + 2], r.stdout


def test_a_server_that_stops_mid_run_is_retried_and_caught_up(bn_data, s3_server, tmp_path):
    fs, url = s3_server.fs(), f"s3://{bucket(s3_server, 'outage')}/run"
    cache = tmp_path / "cache"
    p = _start(remote_argv(bn_data, url, cache), tmp_path / "run.log", remote_env(s3_server, **FAST_RETRY))
    try:
        _wait(lambda: 2 in committed_steps(fs, "outage/run"), p, "the first commit")
        s3_server.stop()
        try:  # training goes on locally: every step is trained and checkpointed while the store is down
            _wait(lambda: (cache / "checkpoints" / "step_0000008").is_dir(), p, "the last local checkpoint")
            _wait(lambda: "warning: uploading to" in (tmp_path / "run.log").read_text(), p, "the warning")
            time.sleep(1.5)  # a few retries fail
        finally:
            s3_server.start()
        assert p.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            stop(p)
    out = (tmp_path / "run.log").read_text()
    assert out.count("warning: uploading to") == 1, out  # one warning line for the outage
    assert f"uploads to {url} resumed" in out and "Traceback" not in out, out
    assert committed_steps(fs, "outage/run")[-1] == STEPS, out
    assert _curve(fs.cat_file("outage/run/log.jsonl").decode()) == _curve((cache / layout.LOG).read_text())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("allow", [False, True])
def test_a_store_unreachable_for_the_whole_run(allow, bn_data, s3_server, tmp_path):
    env = remote_env(s3_server, AWS_ENDPOINT_URL=f"http://127.0.0.1:{_closed_port()}", PRODIP_MIRROR_FLUSH_S="1",
               **FAST_RETRY)
    extra = ("--allow-local-only",) if allow else ()
    r = preloaded.run(remote_argv(bn_data, "s3://nowhere/run", tmp_path / "cache", *extra, steps=4), cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert (tmp_path / "cache" / "checkpoints" / "step_0000004").is_dir()  # trained, locally
    assert "unreachable" in r.stdout.splitlines()[0], r.stdout  # said at the start, once
    if allow:
        assert r.returncode == 0 and "unreachable for the whole run" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode != 0, r.stdout
        one_error(r.returncode, r.stdout, r.stderr, "unreachable for the whole run")
    no_secret(r.stdout, r.stderr, roots=(tmp_path / "cache",))


# ------------------------------------------------------------------------------------------ bad input
def _argv_in_process(data: Path, url: str, cache: Path, *extra: str) -> list[str]:
    return remote_argv(data, url, cache, *extra, steps=2)[2:]


@pytest.fixture
def aws(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.mark.parametrize(("url", "words"), [
    ("foo://bucket/run", "unknown URL scheme foo://"),
    ("s3://", "no bucket"),
    ("s3://no-such-bucket/run", "bucket 'no-such-bucket' does not exist"),
])
def test_bad_urls_are_refused(url, words, bn_data, aws, tmp_path, capsys):
    line = one_error(*call_main("training.train", _argv_in_process(bn_data, url, tmp_path / "cache"), capsys), words)
    assert "--out" in line and not (tmp_path / "cache").exists()


def test_missing_credentials_are_refused(bn_data, aws, tmp_path, monkeypatch, capsys):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    fs = aws.fs()
    fs.mkdir("nocreds")
    rc, out, err = call_main("training.train", _argv_in_process(bn_data, "s3://nocreds/run", tmp_path / "c"), capsys)
    one_error(rc, out, err, "no credentials")
    assert not (tmp_path / "c").exists() and fs.find("nocreds") == []


def test_missing_s3fs_is_one_error_line(bn_data, aws, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # `import s3fs` raises ImportError, as when not installed
    rc, out, err = call_main("training.train", _argv_in_process(bn_data, "s3://any/run", tmp_path / "c"), capsys)
    assert "pip install 'prodip[remote]'" in one_error(rc, out, err, "needs the s3fs package")


def test_cache_without_a_url_is_refused(bn_data, tmp_path, capsys):
    argv = train_argv(bn_data, tmp_path / "run", "--cache", str(tmp_path / "c"))[2:]
    one_error(*call_main("training.train", argv, capsys), "--cache")
    assert list(tmp_path.iterdir()) == []


def test_a_url_holding_another_run_or_foreign_objects_is_refused(bn_data, aws, tmp_path, capsys):
    fs, url = aws.fs(), f"s3://{bucket(aws, 'taken')}/run"
    r = preloaded.run(remote_argv(bn_data, url, tmp_path / "first", steps=2), cwd=REPO, env=remote_env(aws),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    before = {k: fs.info(k)["ETag"] for k in fs.find("taken")}
    first = tree_digest(tmp_path / "first")
    argv = _argv_in_process(bn_data, url, tmp_path / "second", "--set", "d_model=32")
    one_error(*call_main("training.train", argv, capsys), "holds a run with another model config")
    fs.pipe_file("taken/theirs/notes.txt", b"not a run")
    before["taken/theirs/notes.txt"] = fs.info("taken/theirs/notes.txt")["ETag"]
    argv = _argv_in_process(bn_data, "s3://taken/theirs", tmp_path / "third")
    one_error(*call_main("training.train", argv, capsys), "is not a prodip run")
    assert {k: fs.info(k)["ETag"] for k in fs.find("taken")} == before  # nothing written remotely
    assert not (tmp_path / "second").exists() and not (tmp_path / "third").exists()  # nor locally
    assert tree_digest(tmp_path / "first") == first


def test_data_as_a_url_is_pulled_once_checked_and_trains_the_same(bn_data, reference, s3_server, tmp_path):
    """--data s3://…: the prepared folder is pulled into ~/.cache/prodip/data/<hash> (sizes and the store's MD5
    checked), reused by the next run, pulled again when a cached file is damaged; the run equals one on the
    local folder bit for bit."""
    fs = s3_server.fs()
    bucket(s3_server, "datab")
    fs.put(str(bn_data), "datab/bn", recursive=True)
    env = remote_env(s3_server, HOME=str(tmp_path / "home"))

    def train(out: str) -> subprocess.CompletedProcess:
        argv = train_argv(bn_data, tmp_path / out, steps=STEPS, save_every=EVERY)
        argv[argv.index("--data") + 1] = "s3://datab/bn"
        r = preloaded.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert _curve((tmp_path / out / layout.LOG).read_text()) == _curve((reference / layout.LOG).read_text())
        return r

    assert "pulled --data s3://datab/bn" in train("a").stdout
    [cached] = [p for p in (tmp_path / "home" / ".cache" / "prodip" / "data").iterdir() if p.is_dir()]  # + its .lock
    assert "pulled --data" not in train("b").stdout  # reused: nothing downloaded again
    shard = next((cached / "train").glob("shard_*.bin"))
    shard.write_bytes(shard.read_bytes()[:-7])  # a damaged cache
    assert "pulled --data s3://datab/bn" in train("c").stdout
    assert (tmp_path / "a" / layout.RUN_CONFIG).read_text().count("s3://datab/bn") == 1  # run.json names the URL


def test_a_data_url_that_holds_nothing_is_refused(bn_data, aws, tmp_path, capsys):
    bucket(aws, "data-empty")
    for url, words in (("s3://no-such-data/bn", "bucket 'no-such-data' does not exist"),
                       ("s3://data-empty/bn", "holds no files")):
        argv = train_argv(bn_data, tmp_path / "run", steps=2)[2:]
        argv[argv.index("--data") + 1] = url
        line = one_error(*call_main("training.train", argv, capsys), words)
        assert "--data" in line and not (tmp_path / "run").exists()


def _chats(first: int, n: int) -> bytes:
    recs = [{"messages": [{"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": f"{i + 1}"}]}
            for i in range(first, first + n)]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode()


def test_sft_data_as_a_url_is_pulled_once_and_trains_the_same(reference, aws, tmp_path, monkeypatch, capsys):
    """training/sft.py --data s3://…: a folder of conversation files, or one file, pulled into
    ~/.cache/prodip/data/<hash> through the same path as train.py's --data (sizes and MD5 checked),
    reused by the next run; the weights equal a run on the same files given locally."""
    from training.checkpoint import checkpoint_io as ckpt

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    fs = aws.fs()
    _bucket = bucket(aws, "sftb")
    for name, body in (("a.jsonl", _chats(0, 24)), ("b.jsonl", _chats(24, 24))):
        fs.pipe_file(f"{_bucket}/chat/{name}", body)
        (tmp_path / name).write_bytes(body)

    def sft(out: str, *data: str) -> str:
        argv = ["--init", str(reference), "--out", str(tmp_path / out), "--seq-len", "32", "--batch-size", "2",
                "--max-steps", "2", "--eval-every", "0", "--device", "cpu", "--skip-gate", "throughput",
                "--skip-gate", "overfit_one_batch", "--skip-gate", "compiled_vs_eager"]
        for d in data:
            argv += ["--data", d]
        rc, stdout, stderr = call_main("training.sft", argv, capsys)
        assert rc == 0, stdout[-3000:] + stderr[-3000:]
        return stdout

    assert "pulled --data s3://sftb/chat (2 files)" in sft("folder", "s3://sftb/chat")
    assert "pulled --data" not in sft("again", "s3://sftb/chat")  # cached once: nothing downloaded again
    assert "pulled --data s3://sftb/chat/b.jsonl (1 files)" in sft("files", "s3://sftb/chat/a.jsonl",
                                                                   "s3://sftb/chat/b.jsonl")
    sft("local", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    want = ckpt.load(tmp_path / "local").weights
    for out in ("folder", "again", "files"):
        got = ckpt.load(tmp_path / out).weights
        assert all(torch.equal(v, got[k]) for k, v in want.items()), out
    rc, out, err = call_main("training.sft", ["--init", str(reference), "--out", str(tmp_path / "x"),
                                              "--data", "s3://sftb/nothing"], capsys)
    assert "--data" in one_error(rc, out, err, "holds no files") and not (tmp_path / "x").exists()


def test_init_from_a_run_url_starts_from_its_newest_committed_checkpoint(bn_data, reference, aws, tmp_path,
                                                                       monkeypatch, capsys):
    """--init s3://BUCKET/RUN (train.py and sft.py): the run's newest committed checkpoint is pulled into
    an empty cache and the new run starts from exactly its weights — the same run as --init on the
    local folder the remote one was trained in. A URL that holds no run is one error line, nothing written."""
    from training.checkpoint import checkpoint_io as ckpt

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # an empty cache: a new machine
    bucket(aws, "initb")
    local = tmp_path / "trained-here"
    rc, out, err = call_main("training.train", _argv_in_process(bn_data, "s3://initb/base", local), capsys)
    assert rc == 0, out[-2000:] + err[-2000:]
    tiny = ["--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--eval-every", "0", "--device", "cpu",
            "--skip-gate", "throughput", "--skip-gate", "overfit_one_batch", "--skip-gate", "compiled_vs_eager"]
    chats = tmp_path / "chats.jsonl"
    chats.write_bytes(_chats(0, 24))
    shape = ["--preset", "tiny", *SHRINK]  # the base run's model (a fresh train.py run must match it)
    for cli, data, more in (("training.train", bn_data, shape), ("training.sft", chats, [])):
        runs = {}
        for name, init in (("url", "s3://initb/base"), ("local", str(local))):
            runs[name] = tmp_path / f"{cli}-{name}"
            rc, out, err = call_main(cli, ["--init", init, "--data", str(data), "--out", str(runs[name]), *tiny,
                                           *more], capsys)
            assert rc == 0, out[-2000:] + err[-2000:]
        want, got = ckpt.load(runs["local"]).weights, ckpt.load(runs["url"]).weights
        assert want.keys() == got.keys() and all(torch.equal(v, got[k]) for k, v in want.items()), cli
    for cli, data, more in (("training.train", bn_data, shape), ("training.sft", chats, [])):
        rc, out, err = call_main(cli, ["--init", "s3://initb/nothing", "--data", str(data),
                                       "--out", str(tmp_path / "x"), *tiny, *more], capsys)
        assert "s3://initb/nothing" in one_error(rc, out, err, "holds no committed checkpoint"), cli
        assert not (tmp_path / "x").exists()

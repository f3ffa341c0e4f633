"""A run that lives in object storage (training/remote.py, training/loop/mirror.py, docs/rented.md).

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
Credentials never appear in any output or in any file written locally or remotely.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import stop
from fixtures_reliability import REPO, call_main, child_env, one_error, train_argv, tree_digest
from fixtures_remote import SECRET
from safetensors.torch import load_file

from training import layout
from training.cli import EXIT_PREEMPTED

pytest.importorskip("s3fs", reason="opt-in: pip install 'prodip[remote]' (s3fs) for the remote-run tests")
pytest.importorskip("moto", reason="opt-in: pip install 'moto[server]' for the remote-run tests")

TIMEOUT_S = 300
POLL_S = 0.01
STEPS, EVERY = 8, 2
FAST_RETRY = {"PRODIP_MIRROR_BACKOFF_MAX_S": "0.5"}


def _argv(data: Path, url: str, cache: Path, *extra: str, steps: int = STEPS, save_every: int = EVERY) -> list[str]:
    argv = train_argv(data, Path("placeholder"), "--cache", str(cache), *extra, steps=steps, save_every=save_every)
    argv[argv.index("--out") + 1] = url
    return argv


def _env(server, **more: str) -> dict[str, str]:
    return {**child_env(), **server.env(), **more}


def _bucket(server, name: str) -> str:
    server.fs().mkdir(name)
    return name


def _curve(log: str) -> list[tuple[int, float, float]]:
    recs = [json.loads(line) for line in log.splitlines() if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r and "step" in r]


def _committed(fs, root: str) -> list[int]:
    """Steps whose commit marker is in the store (read by the test's own client)."""
    fs.invalidate_cache()
    if not fs.exists(f"{root}/checkpoints"):
        return []
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/checkpoints", refresh=True)]
    return sorted(int(n[5:12]) for n in names if n.endswith(".commit.json"))


def _no_secret(*texts: str, roots: tuple[Path, ...] = (), fs=None, remote_root: str = "") -> None:
    for t in texts:
        assert SECRET not in t
    for root in roots:
        for p in root.rglob("*"):
            assert not p.is_file() or SECRET.encode() not in p.read_bytes(), p
    if fs is not None:
        for key in fs.find(remote_root):
            assert SECRET.encode() not in fs.cat_file(key), key


@pytest.fixture(scope="module")
def reference(bn_data, tmp_path_factory) -> Path:
    """The uninterrupted local run the remote runs must equal."""
    out = tmp_path_factory.mktemp("remote-ref") / "run"
    r = subprocess.run(train_argv(bn_data, out, steps=STEPS, save_every=EVERY), cwd=REPO, env=child_env(),
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
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def test_kill9_mid_upload_then_resume_on_an_empty_cache_is_bit_exact(bn_data, reference, s3_server, tmp_path):
    fs, url = s3_server.fs(), f"s3://{_bucket(s3_server, 'kill9')}/runs/r1"
    s3_server.hold = "r1/checkpoints/step_0000006/optim.safetensors"  # config + weights up, this one in flight
    s3_server.held.clear()
    p = _start(_argv(bn_data, url, tmp_path / "cache1"), tmp_path / "first.log", _env(s3_server))
    try:
        _wait(s3_server.held.is_set, p, "the upload of step 6")
        p.kill()  # SIGKILL, mid-upload
        p.wait(timeout=60)
    finally:
        s3_server.hold = ""
        s3_server.release.set()  # the held request fails: the file never lands
    time.sleep(0.2)
    s3_server.release.clear()
    assert _committed(fs, "kill9/runs/r1") == [2, 4]
    assert fs.exists("kill9/runs/r1/checkpoints/step_0000006/model.safetensors")  # a partial upload is there

    r = subprocess.run(_argv(bn_data, url, tmp_path / "cache2"), cwd=REPO, env=_env(s3_server),
                       capture_output=True, text=True, timeout=TIMEOUT_S)  # a new machine: an empty cache
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoints/step_0000006 is incomplete" in r.stdout and "ignored" in r.stdout, r.stdout
    assert "resumed from" in r.stdout and "(step 4," in r.stdout, r.stdout
    want = _curve((reference / layout.LOG).read_text())
    assert [s for s, _, _ in want] == list(range(1, STEPS + 1))
    assert _curve((tmp_path / "cache2" / layout.LOG).read_text()) == want, "per-step losses differ"
    assert _curve(fs.cat_file("kill9/runs/r1/log.jsonl").decode()) == want, "the mirrored log differs"
    assert _committed(fs, "kill9/runs/r1") == [4, 6, 8]  # --keep-last 3 pruned the store too
    remote_w = tmp_path / "w.safetensors"
    fs.get_file("kill9/runs/r1/checkpoints/step_0000008/model.safetensors", str(remote_w))
    a, b = load_file(str(remote_w)), load_file(str(reference / "checkpoints/step_0000008/model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "final weights differ"
    _no_secret(r.stdout, r.stderr, (tmp_path / "first.log").read_text(), roots=(tmp_path / "cache2",), fs=fs,
               remote_root="kill9")


def test_sigterm_commits_the_checkpoint_before_exit_and_a_new_machine_resumes(bn_data, s3_server, tmp_path):
    fs, url = s3_server.fs(), f"s3://{_bucket(s3_server, 'sigterm')}/run"
    steps = 40
    argv = _argv(bn_data, url, tmp_path / "cache1", steps=steps, save_every=0)  # only the signal's checkpoint
    p = _start(argv, tmp_path / "first.log", _env(s3_server))
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
    assert _committed(fs, "sigterm/run") == [n], out  # uploaded and committed before the process exited
    r = subprocess.run(_argv(bn_data, url, tmp_path / "cache2", steps=n + 2, save_every=0), cwd=REPO,
                       env=_env(s3_server), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"(step {n}," in r.stdout and _committed(fs, "sigterm/run") == [n, n + 2], r.stdout


def test_a_server_that_stops_mid_run_is_retried_and_caught_up(bn_data, s3_server, tmp_path):
    fs, url = s3_server.fs(), f"s3://{_bucket(s3_server, 'outage')}/run"
    cache = tmp_path / "cache"
    p = _start(_argv(bn_data, url, cache), tmp_path / "run.log", _env(s3_server, **FAST_RETRY))
    try:
        _wait(lambda: 2 in _committed(fs, "outage/run"), p, "the first commit")
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
    assert _committed(fs, "outage/run")[-1] == STEPS, out
    assert _curve(fs.cat_file("outage/run/log.jsonl").decode()) == _curve((cache / layout.LOG).read_text())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("allow", [False, True])
def test_a_store_unreachable_for_the_whole_run(allow, bn_data, s3_server, tmp_path):
    env = _env(s3_server, AWS_ENDPOINT_URL=f"http://127.0.0.1:{_closed_port()}", PRODIP_MIRROR_FLUSH_S="1",
               **FAST_RETRY)
    extra = ("--allow-local-only",) if allow else ()
    r = subprocess.run(_argv(bn_data, "s3://nowhere/run", tmp_path / "cache", *extra, steps=4), cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert (tmp_path / "cache" / "checkpoints" / "step_0000004").is_dir()  # trained, locally
    assert "unreachable" in r.stdout.splitlines()[0], r.stdout  # said at the start, once
    if allow:
        assert r.returncode == 0 and "unreachable for the whole run" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode != 0, r.stdout
        one_error(r.returncode, r.stdout, r.stderr, "unreachable for the whole run")
    _no_secret(r.stdout, r.stderr, roots=(tmp_path / "cache",))


# ------------------------------------------------------------------------------------------ bad input
def _argv_in_process(data: Path, url: str, cache: Path, *extra: str) -> list[str]:
    return _argv(data, url, cache, *extra, steps=2)[2:]


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
    fs, url = aws.fs(), f"s3://{_bucket(aws, 'taken')}/run"
    r = subprocess.run(_argv(bn_data, url, tmp_path / "first", steps=2), cwd=REPO, env=_env(aws),
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


def test_export_pulls_the_newest_committed_checkpoint_from_a_url(bn_data, s3_server, tmp_path):
    """`python -m export gguf s3://BUCKET/RUN --q4`: the run's newest committed checkpoint is pulled into
    the default cache (~/.cache/prodip/runs/<hash>, HOME here is the test's) and exported there."""
    fs, url = s3_server.fs(), f"s3://{_bucket(s3_server, 'export')}/run"
    r = subprocess.run(_argv(bn_data, url, tmp_path / "cache", steps=4), cwd=REPO, env=_env(s3_server),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    fs.pipe_file("export/run/checkpoints/step_0000006/model.safetensors", b"a partial upload")  # no marker
    home = tmp_path / "home"
    env = _env(s3_server, HOME=str(home))
    e = subprocess.run([sys.executable, "-m", "export", "gguf", url, "--q4", "--no-parity"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert e.returncode == 0, e.stdout[-3000:] + e.stderr[-3000:]
    assert "step_0000006 is incomplete" in e.stderr and "pulled" in e.stderr, e.stderr
    [cache] = (home / ".cache" / "prodip" / "runs").iterdir()
    assert sorted(p.name for p in (cache / "checkpoints").iterdir()) == ["step_0000004"]
    ggufs = list((cache / layout.EXPORT / layout.GGUF_DIR).glob("*Q4_K_M*.gguf"))
    assert len(ggufs) == 1 and f"wrote {ggufs[0]}" in e.stdout, e.stdout
    _no_secret(e.stdout, e.stderr, roots=(home,))


def test_export_of_a_url_without_a_committed_checkpoint_is_refused(s3_server, tmp_path):
    fs = s3_server.fs()
    _bucket(s3_server, "exp-empty")
    fs.pipe_file("exp-empty/run/checkpoints/step_0000002/model.safetensors", b"partial")
    e = subprocess.run([sys.executable, "-m", "export", "gguf", "s3://exp-empty/run", "--q4"], cwd=REPO,
                       env=_env(s3_server, HOME=str(tmp_path)), capture_output=True, text=True, timeout=TIMEOUT_S)
    one_error(e.returncode, e.stdout, e.stderr, "holds no committed checkpoint")
    assert not (tmp_path / ".cache").exists()  # nothing pulled, nothing written


def test_data_as_a_url_is_pulled_once_checked_and_trains_the_same(bn_data, reference, s3_server, tmp_path):
    """--data s3://…: the prepared folder is pulled into ~/.cache/prodip/data/<hash> (sizes and the store's MD5
    checked), reused by the next run, pulled again when a cached file is damaged; the run equals one on the
    local folder bit for bit."""
    fs = s3_server.fs()
    _bucket(s3_server, "datab")
    fs.put(str(bn_data), "datab/bn", recursive=True)
    env = _env(s3_server, HOME=str(tmp_path / "home"))

    def train(out: str) -> subprocess.CompletedProcess:
        argv = train_argv(bn_data, tmp_path / out, steps=STEPS, save_every=EVERY)
        argv[argv.index("--data") + 1] = "s3://datab/bn"
        r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert _curve((tmp_path / out / layout.LOG).read_text()) == _curve((reference / layout.LOG).read_text())
        return r

    assert "pulled --data s3://datab/bn" in train("a").stdout
    [cached] = (tmp_path / "home" / ".cache" / "prodip" / "data").iterdir()
    assert "pulled --data" not in train("b").stdout  # reused: nothing downloaded again
    shard = next((cached / "train").glob("shard_*.bin"))
    shard.write_bytes(shard.read_bytes()[:-7])  # a damaged cache
    assert "pulled --data s3://datab/bn" in train("c").stdout
    assert (tmp_path / "a" / layout.RUN_CONFIG).read_text().count("s3://datab/bn") == 1  # run.json names the URL


def test_a_data_url_that_holds_nothing_is_refused(bn_data, aws, tmp_path, capsys):
    _bucket(aws, "data-empty")
    for url, words in (("s3://no-such-data/bn", "bucket 'no-such-data' does not exist"),
                       ("s3://data-empty/bn", "holds no files")):
        argv = train_argv(bn_data, tmp_path / "run", steps=2)[2:]
        argv[argv.index("--data") + 1] = url
        line = one_error(*call_main("training.train", argv, capsys), words)
        assert "--data" in line and not (tmp_path / "run").exists()

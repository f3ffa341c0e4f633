"""Exports of a run that lives in object storage (export.writeback, training.store.remote_run), against moto's
S3-compatible server on 127.0.0.1 with real s3fs clients (tests/fixtures_remote.py):

- `python -m export gguf s3://BUCKET/RUN --q4` pulls the newest committed checkpoint (a partial upload
  named and ignored), exports it in the cache, and only once parity passed writes the folder back to
  URL/export/ with its commit marker last: every uploaded file's sha256 equals the local export's.
- A second export without --force is one `error:` line and changes nothing, remotely or locally;
  `--out DIR` exports to DIR only; --no-parity keeps the exports local and says so.
- `python -m serving s3://BUCKET/RUN/export/gguf/FILE.gguf` pulls that committed file (sha256 checked) and
  answers from it.
- kill -9 while the GGUF is being uploaded: files but no marker; serving refuses it, a plain export
  refuses to replace it, --force does.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import moto  # noqa: F401  (dev dependencies, as s3fs: absent, this module fails, never skips)
import preloaded
import pytest
import s3fs  # noqa: F401
from fixtures_reliability import REPO, one_error, tree_digest
from fixtures_remote import TIMEOUT_S, bucket, no_secret, remote_argv, remote_env

from training.runfiles import layout


def _export(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", "export", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _etags(fs, root: str) -> dict[str, str]:
    fs.invalidate_cache()
    return {k: fs.info(k)["ETag"] for k in fs.find(root)}


def test_export_pulls_the_newest_committed_checkpoint_from_a_url(bn_data, s3_server, tmp_path):
    """`python -m export gguf s3://BUCKET/RUN --q4`: the run's newest committed checkpoint is pulled into
    the default cache (~/.cache/prodip/runs/<hash>, HOME here is the test's) and exported there."""
    fs, url = s3_server.fs(), f"s3://{bucket(s3_server, 'export')}/run"
    r = preloaded.run(remote_argv(bn_data, url, tmp_path / "cache", steps=4), cwd=REPO, env=remote_env(s3_server),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    fs.pipe_file("export/run/checkpoints/step_0000006/model.safetensors", b"a partial upload")  # no marker
    home = tmp_path / "home"
    env = remote_env(s3_server, HOME=str(home))
    e = preloaded.run([sys.executable, "-m", "export", "gguf", url, "--q4", "--no-parity"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert e.returncode == 0, e.stdout[-3000:] + e.stderr[-3000:]
    assert "step_0000006 is incomplete" in e.stderr and "pulled" in e.stderr, e.stderr
    [cache] = (home / ".cache" / "prodip" / "runs").glob("*/run")
    assert sorted(p.name for p in (cache / "checkpoints").iterdir()) == ["step_0000004"]
    ggufs = list((cache / layout.EXPORT / layout.GGUF_DIR).glob("*Q4_K_M*.gguf"))
    assert len(ggufs) == 1 and f"wrote {ggufs[0]}" in e.stdout, e.stdout
    assert "not uploaded" in e.stderr and not fs.exists("export/run/export"), e.stderr  # --no-parity: kept local
    no_secret(e.stdout, e.stderr, roots=(home,))


def test_export_of_a_url_without_a_committed_checkpoint_is_refused(s3_server, tmp_path):
    fs = s3_server.fs()
    bucket(s3_server, "exp-empty")
    fs.pipe_file("exp-empty/run/checkpoints/step_0000002/model.safetensors", b"partial")
    e = preloaded.run([sys.executable, "-m", "export", "gguf", "s3://exp-empty/run", "--q4"], cwd=REPO,
                       env=remote_env(s3_server, HOME=str(tmp_path)), capture_output=True, text=True, timeout=TIMEOUT_S)
    one_error(e.returncode, e.stdout, e.stderr, "holds no committed checkpoint")
    assert not (tmp_path / ".cache").exists()  # nothing pulled, nothing written


@pytest.fixture(scope="module")
def remote_run(bn_data, s3_server, tmp_path_factory) -> str:
    """A 4-step run trained into s3://writeback/run."""
    url = f"s3://{bucket(s3_server, 'writeback')}/run"
    r = preloaded.run(remote_argv(bn_data, url, tmp_path_factory.mktemp("wb") / "cache", steps=4), cwd=REPO,
                       env=remote_env(s3_server), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return url


def test_exports_are_written_back_after_parity_and_never_replaced_without_force(remote_run, s3_server, tmp_path):
    fs, home = s3_server.fs(), tmp_path / "home"
    env = remote_env(s3_server, HOME=str(home))
    e = _export(env, "gguf", remote_run, "--q4")
    assert e.returncode == 0, e.stdout[-3000:] + e.stderr[-3000:]
    assert f"committed by {remote_run}/export.commit.json" in e.stdout, e.stdout
    [cache] = (home / ".cache" / "prodip" / "runs").glob("*/run")
    local = {p.relative_to(cache / layout.EXPORT).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted((cache / layout.EXPORT).rglob("*")) if p.is_file()}
    assert "gguf/run-Q4_K_M.gguf" in local and layout.PARITY_JSON in local, local  # named for the run
    fs.invalidate_cache()
    uploaded = {k[len("writeback/run/export/"):]: hashlib.sha256(fs.cat_file(k)).hexdigest()
                for k in fs.find("writeback/run/export")}
    assert uploaded == local  # the verified files, byte for byte
    marker = json.loads(fs.cat_file("writeback/run/export.commit.json"))
    assert {k: v["sha256"] for k, v in marker["files"].items()} == local and marker["step"] == 4
    before, cached = _etags(fs, "writeback"), tree_digest(cache)

    again = _export(env, "gguf", remote_run, "--q4")  # refused before anything is pulled or written
    one_error(again.returncode, again.stdout, again.stderr, "export exists; use --force")
    assert _etags(fs, "writeback") == before and tree_digest(cache) == cached

    out = _export(env, "gguf", remote_run, "--q4", "--no-parity", "--out", str(tmp_path / "mine"))
    assert out.returncode == 0 and "uploaded" not in out.stdout, out.stdout + out.stderr  # --out: local only
    assert list((tmp_path / "mine" / layout.GGUF_DIR).glob("*Q4_K_M.gguf"))
    forced = _export(env, "gguf", remote_run, "--q4", "--no-parity", "--force")
    assert forced.returncode == 0 and "not uploaded" in forced.stderr, forced.stdout + forced.stderr
    assert _etags(fs, "writeback") == before  # only exports that passed parity go back
    no_secret(e.stdout, e.stderr, again.stderr, roots=(home,), fs=fs, remote_root="writeback")

    # serving, on another machine (an empty HOME): the committed GGUF is pulled, checked, and answers
    [q4] = [k for k in local if k.endswith("Q4_K_M.gguf")]
    other = tmp_path / "other-home"
    s = preloaded.run([sys.executable, "-m", "serving", f"{remote_run}/export/{q4}", "--prompt", "বাংলাদেশ",
                        "--max-tokens", "4", "--temperature", "0"], cwd=REPO, env=remote_env(s3_server, HOME=str(other)),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert s.returncode == 0 and "sha256 checked" in s.stderr, s.stdout[-2000:] + s.stderr[-2000:]
    [pulled] = (other / ".cache" / "prodip" / "runs").glob(f"*/run/export/{q4}")
    assert hashlib.sha256(pulled.read_bytes()).hexdigest() == local[q4]
    bad = preloaded.run([sys.executable, "-m", "serving", f"{remote_run}/export/gguf/nope.gguf", "--prompt", "x"],
                         cwd=REPO, env=remote_env(s3_server, HOME=str(other)), capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    one_error(bad.returncode, bad.stdout, bad.stderr, "not in s3://writeback/run's committed export")


def test_an_export_upload_cut_short_is_never_served_and_force_replaces_it(bn_data, s3_server, tmp_path):
    """The marker goes last: kill -9 while the GGUF is in flight (the server holds it) leaves files but no
    marker, which serving refuses; a plain export then refuses to replace them, --force does."""
    fs, url = s3_server.fs(), f"s3://{bucket(s3_server, 'cut')}/run"
    r = preloaded.run(remote_argv(bn_data, url, tmp_path / "cache", steps=4), cwd=REPO, env=remote_env(s3_server),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    env = remote_env(s3_server, HOME=str(tmp_path / "home"))
    s3_server.hold = "cut/run/export/gguf/run-Q4_K_M.gguf"  # README.md and the rest before it are up
    s3_server.held.clear()
    p = subprocess.Popen([sys.executable, "-m", "export", "gguf", url, "--q4"], cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert s3_server.held.wait(TIMEOUT_S), "the GGUF's upload never started"
        fs.invalidate_cache()
        assert fs.exists("cut/run/export/README.md") and not fs.exists("cut/run/export.commit.json")
        p.kill()
        p.wait(timeout=60)
    finally:
        s3_server.hold = ""
        s3_server.release.set()
    time.sleep(0.2)
    s3_server.release.clear()
    fs.invalidate_cache()
    assert not fs.exists("cut/run/export.commit.json")
    s = preloaded.run([sys.executable, "-m", "serving", f"{url}/export/gguf/run-Q4_K_M.gguf", "--prompt", "x"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    one_error(s.returncode, s.stdout, s.stderr, "holds no committed export")
    again = _export(env, "gguf", url, "--q4")
    one_error(again.returncode, again.stdout, again.stderr, "export exists; use --force")
    forced = _export(env, "gguf", url, "--q4", "--force")
    assert forced.returncode == 0 and "committed by" in forced.stdout, forced.stdout[-2000:] + forced.stderr[-2000:]
    marker = json.loads(fs.cat_file("cut/run/export.commit.json"))
    fs.invalidate_cache()
    assert sorted(marker["files"]) == sorted(k[len("cut/run/export/"):] for k in fs.find("cut/run/export"))

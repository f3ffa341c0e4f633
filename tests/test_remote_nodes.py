"""A run whose --out is a store URL, trained on several nodes (training/mirror/node_caches.py).

Two simulated nodes (one torchrun each, one CPU rank each, tests/test_distributed.py's torchrun_nodes),
each with its own --cache folder (its own disk), against a real S3-compatible server on 127.0.0.1
(tests/fixtures_remote.py):

0. (the module's reference) an uninterrupted 2-node run into the store: node 1's cache is never written.
1. stopped at step 2 (--stop-at), then relaunched on two NEW empty caches: both nodes resume from the
   committed remote checkpoint, and the per-step losses equal the uninterrupted run's bit for bit.
2. node 0's cache holds a newer checkpoint (step 4) than the store's newest committed one (its marker
   and the later steps gone, as after an outage): node 0 commits it first, node 1 pulls it, both resume
   from it, bit for bit.
3. the store is unreachable at relaunch while node 0's newest checkpoint is not in it: every node exits
   non-zero with one `error:` line, and nothing trains.
Tests 2 and 3 start from copies of the reference's store prefix and node 0 cache (one launch each).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import moto  # noqa: F401  (dev dependencies, as s3fs: absent, this module fails, never skips)
import pytest
import s3fs  # noqa: F401
from conftest import REPO
from fixtures_reliability import tree_digest
from fixtures_remote import bucket, committed_steps, no_secret
from test_distributed import COMMON, STEPS, torchrun_nodes

from training.checkpoint import checkpoint_io as ckpt
from training.runfiles import layout

TRAIN_PY = REPO / "training" / "train.py"


def _args(data: Path, url: str, cache: Path, *extra: str) -> list[str]:
    return [*COMMON, "--data", str(data), "--out", url, "--cache", str(cache), "--batch-size", "4", "--save-every",
            "2", "--keep-last", "0", *extra]


def _curve(run: Path) -> list[tuple]:
    recs = [json.loads(x) for x in (run / layout.LOG).read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in recs if "loss" in r]


def _nodes(data: Path, url: str, caches: list[Path], *extra: str) -> list[subprocess.CompletedProcess]:
    """Node i trains with --cache caches[i] (its own disk); every node's torchrun gets this process's env."""
    return torchrun_nodes(TRAIN_PY, [_args(data, url, c, *extra) for c in caches])


def _ok(nodes: list[subprocess.CompletedProcess]) -> None:
    for i, p in enumerate(nodes):
        assert p.returncode == 0, (i, p.stdout[-3000:], p.stderr[-3000:])


def _copy_store(fs, src: str, dst: str, *, drop: tuple[int, ...] = (), uncommit: tuple[int, ...] = ()) -> None:
    """The store's run at `src` copied to `dst`, the checkpoints `drop` removed (marker first, as
    training.store.remote_run does) and the markers of `uncommit` alone."""
    for key in fs.find(src):
        fs.copy(key, dst + key[len(src):])
    for s in drop:
        fs.rm(f"{dst}/checkpoints/{ckpt.step_dir_name(s)}.commit.json")
        fs.rm(f"{dst}/checkpoints/{ckpt.step_dir_name(s)}", recursive=True)
    for s in uncommit:
        fs.rm(f"{dst}/checkpoints/{ckpt.step_dir_name(s)}.commit.json")
    fs.invalidate_cache()


@pytest.fixture
def aws(s3_server, monkeypatch):
    """The store's variables in this process's environment, which torchrun_nodes passes to every node."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture(scope="module")
def reference(bn_data, s3_server, tmp_path_factory) -> Path:
    """The uninterrupted 2-node URL run (s3://nodes/ref, every checkpoint kept): node 0's cache."""
    root = tmp_path_factory.mktemp("nodes-ref")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():
            mp.setenv(k, v)
        bucket(s3_server, "nodes")
        _ok(_nodes(bn_data, "s3://nodes/ref", [root / "r0", root / "r1"]))
    assert [s for s, *_ in _curve(root / "r0")] == list(range(1, STEPS + 1))
    assert committed_steps(s3_server.fs(), "nodes/ref") == [2, 4, 6, 8]
    assert not (root / "r1").exists()  # a fresh start: node 1's cache is never written (rank 0 alone writes)
    return root / "r0"


def test_two_nodes_resume_from_the_store_on_new_empty_caches(bn_data, reference, aws, tmp_path):
    fs, url = aws.fs(), "s3://nodes/t1"
    _ok(_nodes(bn_data, url, [tmp_path / "a0", tmp_path / "a1"], "--stop-at", "2"))
    assert committed_steps(fs, "nodes/t1") == [2]
    assert not (tmp_path / "a1").exists()

    node0, node1 = _nodes(bn_data, url, [tmp_path / "b0", tmp_path / "b1"])  # two new machines: empty caches
    _ok([node0, node1])
    assert "resumed from" in node0.stdout and "(step 2," in node0.stdout, node0.stdout[-2000:]
    assert "committing node 0's checkpoint" not in node0.stdout  # it was in the store already
    name = ckpt.step_dir_name(2)
    assert [p.name for p in (tmp_path / "b1" / "checkpoints").iterdir()] == [name]  # that step alone
    assert tree_digest(tmp_path / "b1" / "checkpoints" / name) == tree_digest(tmp_path / "a0" / "checkpoints" / name)
    assert (tmp_path / "b1" / layout.RUN_CONFIG).read_bytes() == (tmp_path / "a0" / layout.RUN_CONFIG).read_bytes()
    assert _curve(tmp_path / "b0") == _curve(reference), "per-step losses differ from the uninterrupted run"
    assert committed_steps(fs, "nodes/t1") == [2, 4, 6, 8]
    no_secret(node0.stdout, node0.stderr, node1.stdout, node1.stderr, roots=(tmp_path,), fs=fs, remote_root="nodes/t1")


def test_node_0s_newer_checkpoint_is_committed_first_then_both_nodes_resume_from_it(bn_data, reference, aws,
                                                                                       tmp_path):
    fs, url = aws.fs(), "s3://nodes/t2"
    _copy_store(fs, "nodes/ref", "nodes/t2", drop=(6, 8), uncommit=(4,))  # the store went down before step 4's marker
    assert committed_steps(fs, "nodes/t2") == [2]
    cache0 = tmp_path / "c0"
    shutil.copytree(reference, cache0)  # node 0's machine: its cache stopped at step 4
    for s in (6, 8):
        ckpt.remove(cache0 / "checkpoints" / ckpt.step_dir_name(s))

    node0, node1 = _nodes(bn_data, url, [cache0, tmp_path / "d1"])  # node 0's machine, a new node 1
    _ok([node0, node1])
    assert "committing node 0's checkpoint step 4" in node0.stdout, node0.stdout[-2000:]
    assert "resumed from" in node0.stdout and "(step 4," in node0.stdout, node0.stdout[-2000:]
    name = ckpt.step_dir_name(4)
    assert [p.name for p in (tmp_path / "d1" / "checkpoints").iterdir()] == [name]
    assert tree_digest(tmp_path / "d1" / "checkpoints" / name) == tree_digest(reference / "checkpoints" / name)
    assert _curve(cache0) == _curve(reference), "per-step losses differ from the uninterrupted run"
    assert committed_steps(fs, "nodes/t2") == [2, 4, 6, 8]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_store_with_node_0_ahead_of_it_stops_every_node(bn_data, reference, aws, tmp_path, monkeypatch):
    cache0 = tmp_path / "e0"
    shutil.copytree(reference, cache0)  # node 0's cache: step 8, which the store at nodes/t3 never got
    before = tree_digest(cache0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")  # the store is down
    monkeypatch.setenv("PRODIP_MIRROR_FLUSH_S", "1")
    nodes = _nodes(bn_data, "s3://nodes/t3", [cache0, tmp_path / "e1"], "--max-steps", "10")
    for i, p in enumerate(nodes):
        assert p.returncode != 0, (i, p.stdout[-2000:])
        errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
        assert len(errors) == 1, (i, p.stderr[-3000:])
        assert f"node 0's newest checkpoint, step {STEPS}" in errors[0] and "is not in the store" in errors[0], errors
        assert "cannot get it" in errors[0] and "Traceback" not in p.stdout, errors
    assert "resumed from" not in nodes[0].stdout
    assert tree_digest(cache0) == before  # nothing trained, nothing written
    assert not (tmp_path / "e1").exists()


def test_nodes_sharing_one_machine_take_turns_and_a_cache_ahead_of_node_0_is_refused(reference, aws, tmp_path,
                                                                                     monkeypatch):
    """mirror_nodes.pull_node in process (a node's local rank 0): two nodes on one machine with the same cache
    pull at once, and the lock makes the second find the first's copy (one download); a node whose cache
    is rank 0's own folder pulls nothing; one whose cache holds a newer checkpoint than rank 0's is refused."""
    from concurrent.futures import ThreadPoolExecutor

    from training import distributed as D
    from training.config_sections import MirrorSection
    from training.loop.rank_agreement import TrainError
    from training.mirror.node_caches import NODE_FILES, pull_node, where
    from training.mirror.run_mirror import Mirror
    from training.run_context import RunContext
    from training.store import remote_run as remote

    downloads = []
    real = remote.Remote.download_checkpoint

    def counted(self, step, marker, dest):
        downloads.append(step)
        return real(self, step, marker, dest)

    monkeypatch.setattr(remote.Remote, "download_checkpoint", counted)
    plan = {"step": 4, "over": False, "missing": "", "where": ("node-0-host", "/its/cache"),
            "files": {n: (reference / n).read_bytes() if (reference / n).is_file() else None for n in NODE_FILES}}

    def node(rank: int, cache: Path) -> Mirror:
        return Mirror(MirrorSection.default(out="s3://nodes/ref", cache=str(cache), keep_last=0),
                      RunContext(D.Dist(rank, 0, 3, 1), out=cache))

    shared = tmp_path / "shared"
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: pull_node(node(r, shared), plan), (1, 2)))
    assert downloads == [4]
    name = ckpt.step_dir_name(4)
    assert [p.name for p in (shared / "checkpoints").iterdir()] == [name]
    assert tree_digest(shared / "checkpoints" / name) == tree_digest(reference / "checkpoints" / name)
    assert layout.read_run_config(shared) == layout.read_run_config(reference)

    pull_node(node(1, tmp_path / "own"), {**plan, "where": where(tmp_path / "own")})  # rank 0's own folder
    assert not (tmp_path / "own").exists() and downloads == [4]

    with pytest.raises(TrainError, match=r"holds checkpoint step 4, but rank 0 resumes from step 2"):
        pull_node(node(1, shared), {**plan, "step": 2})

"""Shared test setup: offline mode, fixtures built from what ships in training/assets, and the
../shared/data location for opt-in breadth.

Every fixture here builds on training/assets only, so a fresh clone runs every test. Tests that read
../shared/data are opt-in breadth, each beside a test of the same behaviour on training/assets: they
skip with an "opt-in:" message when it is absent, and fail instead when PRODIP_SHARED_DATA=1 (.ci/run
sets it: CI has ../shared). Under CI=true a skip fails the run unless the test is on the allow-list
tests/skips_allowed.txt (GPU-only tests, opt-in breadth on ../shared) and its reason is an "opt-in:" one:
the llama.cpp tools, foreign GGUFs, ONNX Runtime GenAI and the openai client must run in CI.

The fixture modules are registered once here (`pytest_plugins`): a test module that imported a fixture
by name would define its own copy, and pytest would build that session fixture again for it."""

from __future__ import annotations

import fnmatch
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import preloaded
import pytest
from filelock import FileLock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two xdist workers and their children share 2 cores: an OpenMP thread that finished its share sleeps instead of
# spinning on the core another process needs (read when torch loads, here and in every child).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Each fixture module once, for every test module (see the docstring); registered here, before any test
# module imports it, so pytest rewrites its asserts. fixtures_evaluate serves test_evaluate alone.
pytest_plugins = ("fixtures_export", "fixtures_reliability", "fixtures_foreign_gguf", "fixtures_serve",
                  "fixtures_onnx", "fixtures_gates", "fixtures_remote", "fixtures_init_from")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TATOEBA = ("bn", "dev", "tatoeba_bn.txt")  # 5,120 modern Bangla lines under SHARED_DATA: opt-in breadth


ASSETS = REPO / "training" / "assets"
CORPUS = ASSETS / "corpus"
CHAT_SET = ASSETS / "chat" / "prodip_chat_bn.jsonl"
ORTHOGRAPHY = ASSETS / "text" / "orthography_bn.txt"  # not normalized on purpose: both nukta spellings, ZWJ/ZWNJ
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
OPT_IN = "opt-in:"  # the only skips CI accepts: say what to set to run the test


SHARED_ENV = "PRODIP_SHARED_DATA"  # "1": breadth tests must run (.ci/run sets it: CI has ../shared)


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (torchrun and servers pass it on and clean up), then SIGKILL after `timeout` s; reaped."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def shared_path(*parts: str) -> Path:
    """A path under ../shared/data for an opt-in breadth test. Present: the test runs. Absent: an
    "opt-in:" skip on a user's clone, but a failure when PRODIP_SHARED_DATA=1 says it must be there
    (as in CI, which always has ../shared beside the clone)."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        msg = f"shared data not available: {p} (see ../shared/data/README.md)"
        if os.environ.get(SHARED_ENV) == "1":
            pytest.fail(f"{SHARED_ENV}=1: {msg}")
        pytest.skip(f"{OPT_IN} breadth test on ../shared/data; {msg}")
    return p


ALLOWED_SKIPS_FILE = Path(__file__).with_name("skips_allowed.txt")


def allowed_skips(path: Path = ALLOWED_SKIPS_FILE) -> dict[str, str]:
    """{node-id pattern (fnmatch): why it may skip in CI} from the allow-list: `PATTERN  # REASON` lines.
    A pattern without a reason is refused: the list says why each tier may be absent."""
    out = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pattern, _, why = line.partition("  # ")
        if not why.strip():
            raise ValueError(f"{path.name}:{n}: no reason given for {pattern.strip()!r} (write `PATTERN  # REASON`)")
        out[pattern.strip()] = why.strip()
    return out


def skip_allowed_in_ci(nodeid: str, reason: str, allowed: dict[str, str]) -> bool:
    """A CI skip passes only for an allow-listed test skipping with an "opt-in:" reason."""
    return OPT_IN in reason and any(fnmatch.fnmatchcase(nodeid, p) for p in allowed)


def forbid_unlisted_skip(rep: pytest.TestReport | pytest.CollectReport) -> None:
    """Under CI=true a skip report becomes a failure, unless its node is on tests/skips_allowed.txt and its
    reason is an opt-in one. A skipped test fails; a skipped module (collection) is a collection error."""
    if IN_CI and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if not skip_allowed_in_ci(rep.nodeid, reason, allowed_skips()):
            rep.outcome = "failed"
            rep.longrepr = (f"CI=true forbids this skip (only tests on tests/{ALLOWED_SKIPS_FILE.name} may skip, "
                            f"with an '{OPT_IN} ...' reason): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip inside a test (its body, a fixture, a skip mark)."""
    outcome = yield
    forbid_unlisted_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A skip while a module is imported or collected (a module-level `pytest.importorskip`, or
    `pytest.skip(allow_module_level=True)`): the whole module is gone from the run, and no test report
    would ever say so. Its node id is the module's (tests/test_x.py), so only a module named on the
    allow-list, with an opt-in reason, may skip that way."""
    outcome = yield
    forbid_unlisted_skip(outcome.get_result())


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return shared_path()


# --------------------------------------------------------------------------- built once per test run
T = TypeVar("T")
XDIST_WORKER = "PYTEST_XDIST_WORKER"  # set by pytest-xdist in each worker process (scripts/test.sh runs two)
_BUILT: dict[Path, dict[str, tuple[int, int]]] = {}  # a shared fixture's folder -> its files as built


def files_of(root: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime in ns)} of every file under `root`."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            st = os.stat(os.path.join(d, n))
            out[os.path.relpath(os.path.join(d, n), root)] = (st.st_size, st.st_mtime_ns)
    return out


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """A session fixture's files, built once per test run: `build(folder)` gets an empty folder and returns
    the fixture's (picklable) value. Under pytest-xdist the workers share one build: the first to ask builds
    it under a file lock beside their temporary folders, the others wait and read its value. The folder is
    read-only by contract (copy it to change it): `shared_fixtures_untouched` fails the run if a test wrote
    into it."""
    if not os.environ.get(XDIST_WORKER):
        root = tmp_path_factory.mktemp(name)
        value = build(root)
        _BUILT[root] = files_of(root)
        return value
    return build_shared(tmp_path_factory.getbasetemp().parent, name, build)  # the run's folder, above the workers'


def build_shared(base: Path, name: str, build: Callable[[Path], T]) -> T:
    """`build(base/shared-NAME)` by the first process to ask, under a file lock; every process gets its value."""
    root, done = base / f"shared-{name}", base / f"shared-{name}.pickle"
    with FileLock(str(base / f"shared-{name}.lock")):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a build that failed in another worker
            root.mkdir()
            value = build(root)
            done.write_bytes(pickle.dumps((value, files_of(root))))
    value, _BUILT[root] = pickle.loads(done.read_bytes())
    return value


@pytest.fixture(scope="session", autouse=True)
def shared_fixtures_untouched():
    """After the last test: every folder `built_once` made is as it was built. A test that wrote into one
    would race the other worker's tests reading it (and change what later tests see): copy it first."""
    yield
    changed = [f"{root}: {', '.join(d[:8])}{' ...' if len(d) > 8 else ''}"
               for root, before in _BUILT.items() if (d := changed_files(root, before))]
    assert not changed, "tests wrote into shared fixture folders (copy them first): " + "; ".join(changed)


def changed_files(root: Path, before: dict[str, tuple[int, int]]) -> list[str]:
    """The files under `root` added, removed, resized or rewritten since `before` (files_of)."""
    now = files_of(root)
    return sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))


# --------------------------------------------------------------------------- shared tiny artifacts
@pytest.fixture(scope="session")
def bn_data(tmp_path_factory) -> Path:
    """A prepared data folder (vocab 2048) over the corpus that ships in training/assets."""
    from training.prepare import prepare

    def build(root: Path) -> Path:
        prepare([CORPUS], root / "data", vocab_size=2048, progress=False, workers=1, fertility_floor=1.5)
        return root / "data"

    return built_once(tmp_path_factory, "bn", build)


def run_train(*args: str, check: bool = True):
    """`python training/train.py ARGS` in a subprocess, as a user runs it."""
    import sys

    p = preloaded.run([sys.executable, str(REPO / "training" / "train.py"), *args], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="session")
def tiny_run(bn_data, tmp_path_factory) -> Path:
    """A `tiny` run trained 300 steps on the shipped corpus: the one shared trained model of the suite,
    enough that top-1 agreement means something."""
    def build(root: Path) -> Path:
        run_train("--preset", "tiny", "--data", str(bn_data), "--out", str(root / "tiny"), "--max-steps", "300",
                  "--batch-size", "8", "--seq-len", "128", "--lr", "3e-3", "--warmup-steps", "20",
                  "--eval-every", "100", "--save-every", "300", "--log-every", "100")
        return root / "tiny"

    return built_once(tmp_path_factory, "run", build)


def pytest_configure(config) -> None:
    """An xdist worker runs its in-process torch on one thread: the other worker holds the other core."""
    if os.environ.get(XDIST_WORKER):
        import torch

        torch.set_num_threads(1)


# Seconds each slow test module took (the user-mode run of 2026-12-06 on an idle 2-core machine, `--durations`
# summed per file; the distributed files less what forking their torchrun workers saved, tests/torchrun_forked.py;
# the rest took under 8 s). The longest start first (a longest-first schedule: scripts/test.sh passes
# --no-loadscope-reorder, so xdist hands out files in this order); by default xdist starts the files with the most
# tests first, and the few long end-to-end files ran last on one worker while the other sat idle. test_browser
# builds the suite's trained model (tiny_run) in its setup: started at once, on the worker test_distributed (which
# needs only bn_data) leaves free, no later file waits for it. Stale figures only cost time, never a result.
SLOW_MODULES = {"test_distributed": 170, "test_browser": 144, "test_quickstart": 120, "test_remote": 76,
                "test_sft": 66, "test_remote_nodes": 50, "test_preemption": 43, "test_gpu_validate": 40,
                "test_remote_export": 30, "test_sharded_checkpoint": 28, "test_prepare": 25, "test_train": 25,
                "test_preloaded": 24, "test_lora": 30, "test_gates": 18, "test_prepare_executors": 18,
                "test_crash_safety": 17, "test_distributed_plants": 16, "test_init_from": 16,
                "test_mutation_bench": 16, "test_compile": 13, "test_gpu_path": 13, "test_hostile_inputs": 13,
                "test_plan": 12, "test_evaluate": 12, "test_http_load": 12, "test_lm_eval": 11, "test_imatrix": 11,
                "test_any_gguf": 9, "test_parity": 8,
                # this stop's new modules (measured by their helpers on a loaded machine, scaled to idle)
                "test_web_browser": 20, "test_lora_serving": 15, "test_arm": 10, "test_web_export": 8,
                "test_transformers_js": 8}


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=lambda item: -SLOW_MODULES.get(item.path.stem, 0))  # stable: a file's tests keep their order


SUMMARY: list[str] = []  # lines a test asks to show at the end of the run (the hostile sweep's case count)
_FROM_WORKERS: list[dict] = []  # under pytest-xdist: each finished worker's counts and lines, for the controller


def pytest_sessionfinish(session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its output is not shown; hand it over
        session.config.workeroutput.update(forked_runs=preloaded.forked_runs, summary=SUMMARY)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _FROM_WORKERS.append(getattr(node, "workeroutput", {}))


def pytest_terminal_summary(terminalreporter) -> None:
    """The tests' summary lines, and how many CLI runs were forked from the preloaded interpreter
    (tests/preloaded.py) instead of started cold."""
    for line in SUMMARY + [x for w in _FROM_WORKERS for x in w.get("summary", [])]:
        terminalreporter.write_line(line)
    n = preloaded.forked_runs + sum(w.get("forked_runs", 0) for w in _FROM_WORKERS)
    if n:
        terminalreporter.write_line(f"preloaded: {n} CLI runs forked from the preloaded "
                                    "interpreter (PRODIP_TEST_COLD=1 runs them cold)")

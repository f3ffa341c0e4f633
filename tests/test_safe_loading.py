"""Safe loading: tensors only through safetensors, everything else JSON/TOML; nothing is ever unpickled.

A checkpoint is planted with a live pickle payload (loading it with torch.load(weights_only=False)
creates a marker file): in place of model.safetensors / optim.safetensors, and as *.pt / *.bin
files beside a good checkpoint. Every loader (training.checkpoint.checkpoint_io, train.py's resume,
`python -m export`, serving.load / `python -m serving`) must refuse the first kind with a clear
message, ignore the second, and the marker must never appear.
"""

from __future__ import annotations

import ast
import json
import pickle
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fixtures_reliability import REPO, FileMaker, plant_pickle, run_cli, train_argv

from training.checkpoint import checkpoint_io as ckpt
from training.runfiles import layout

REFUSAL = "never unpickles"
PARALLEL_CLIS = 2
STEP_DIR = "step_0000004"
BESIDE = ("model.pt", "pytorch_model.bin", "optimizer.pt", "training_args.bin", "rng_state.pth")


def _plant_raw_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"model": FileMaker(marker)}, protocol=4))


def _planted(rel_run: Path, root: Path, name: str, where: str, raw: bool = False) -> tuple[Path, Path]:  # noqa: F811
    """A copy of the run whose newest checkpoint holds a pickle in `where`; returns (run, marker)."""
    run = root / name
    shutil.copytree(rel_run, run)
    marker = root / f"{name}.PWNED"
    target = run / "checkpoints" / STEP_DIR
    if where == "beside":
        for f in BESIDE:
            plant_pickle(target / f, marker)
    elif raw:
        _plant_raw_pickle(target / where, marker)
    else:
        plant_pickle(target / where, marker)
    return run, marker


def test_the_payload_is_live(tmp_path):
    """Control: the planted file really does create the marker when unpickled, so the tests below can fail."""
    marker = tmp_path / "control.PWNED"
    plant_pickle(tmp_path / "evil.pt", marker)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "evil.pt", weights_only=True)  # the one allowed torch.load form refuses it
    assert not marker.exists()
    torch.load(tmp_path / "evil.pt", weights_only=False)  # what no prodip code may ever do
    assert marker.exists()


@pytest.mark.parametrize("where,raw", [("model.safetensors", False), ("model.safetensors", True),
                                       ("optim.safetensors", False)])
def test_in_process_loaders_refuse_a_pickle(rel_run, tmp_path, where, raw):  # noqa: F811
    from export.manifest import load_source
    from serving import load

    run, marker = _planted(rel_run, tmp_path, "run", where, raw)
    loaders = [lambda: ckpt.load(run).optimizer_and_rng()]
    if where == "model.safetensors":
        loaders += [lambda: ckpt.load_model(run), lambda: load(run), lambda: load_source(run)]
    for loader in loaders:
        with pytest.raises(ValueError) as e:
            loader()
        msg = str(e.value)
        assert REFUSAL in msg and "pickle" in msg and where in msg and "\n" not in msg, msg
        assert not marker.exists()


def test_files_beside_a_checkpoint_are_never_read(rel_run, tmp_path):  # noqa: F811
    from export.manifest import load_source
    from serving import load

    run, marker = _planted(rel_run, tmp_path, "run", "beside")
    ck = ckpt.load(run)
    assert ck.state["step"] == 4 and ck.optimizer_and_rng()[0]
    ckpt.load_model(run)
    load(run).close()
    load_source(run)
    assert not marker.exists()


def test_clis_refuse_a_pickle_and_never_run_it(rel_run, tmp_path):  # noqa: F811
    data = Path(layout.read_run_config(rel_run)["train"]["data"])
    cases = []  # (name, argv, expect_ok, marker)
    for where in ("model.safetensors", "optim.safetensors", "beside"):
        tag = where.split(".")[0]
        run, marker = _planted(rel_run, tmp_path, f"resume-{tag}", where)
        cases.append((f"train-resume-{tag}", train_argv(data, run, steps=5), where == "beside", marker))
    for where in ("model.safetensors", "beside"):
        tag = where.split(".")[0]
        run, marker = _planted(rel_run, tmp_path, f"export-{tag}", where)
        cases.append((f"export-{tag}", [sys.executable, "-m", "export", "safetensors", str(run), "--no-parity"],
                      where == "beside", marker))
        run, marker = _planted(rel_run, tmp_path, f"serve-{tag}", where)
        cases.append((f"serve-{tag}", [sys.executable, "-m", "serving", str(run), "--prompt", "নমস্কার",
                                       "--max-tokens", "4", "--temperature", "0"], where == "beside", marker))
    with ThreadPoolExecutor(PARALLEL_CLIS) as pool:
        results = list(pool.map(lambda c: run_cli(c[1]), cases))
    for (name, _, ok, marker), r in zip(cases, results, strict=True):
        assert not marker.exists(), f"{name}: the pickle payload ran"
        assert "Traceback" not in r.stderr, f"{name}: {r.stderr}"
        if ok:
            assert r.returncode == 0, f"{name}: {r.stderr[-2000:]}"
        else:
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            assert r.returncode == 2 and len(lines) == 1, f"{name}: rc {r.returncode}: {r.stderr}"
            assert lines[0].startswith("error: ") and REFUSAL in lines[0], f"{name}: {lines[0]}"


def test_a_checkpoint_holds_only_non_executable_formats(rel_run):  # noqa: F811
    c = ckpt.latest(rel_run)
    assert sorted(p.name for p in c.iterdir()) == sorted(
        [ckpt.MODEL_FILE, ckpt.OPTIM_FILE, ckpt.STATE_FILE, ckpt.CONFIG_FILE, ckpt.TOKENIZER_FILE])
    for f in (ckpt.STATE_FILE, ckpt.CONFIG_FILE):
        json.loads((c / f).read_text(encoding="utf-8"))
    for f in (ckpt.MODEL_FILE, ckpt.OPTIM_FILE):
        head = (c / f).read_bytes()[:16]
        assert not head.startswith(ckpt.PICKLE_HEADS), f
    assert not (c / ckpt.TOKENIZER_FILE).read_bytes().startswith(ckpt.PICKLE_HEADS)  # a SentencePiece protobuf


# ------------------------------------------------------------------ no unpickling call in the source tree
PACKAGES = ("training", "serving", "export", "demo", "scripts")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve", "marshal"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_calls(source: str) -> list[tuple[int, str]]:
    """(line, why) for every call that could unpickle: pickle-family loads, torch.load without
    weights_only=True, numpy loads with allow_pickle=True, pandas.read_pickle."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] in PICKLE_MODULES for m in mods):
                found.append((node.lineno, f"imports {mods}"))
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        if name.split(".")[0] in PICKLE_MODULES or name.endswith(("read_pickle", "Unpickler")):
            found.append((node.lineno, name))
        elif name == "torch.load" or name.endswith(".torch.load"):
            wo = kw.get("weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                found.append((node.lineno, f"{name} without weights_only=True"))
        elif name.split(".")[-1] in ("load", "loadtxt") and name.split(".")[0] in ("np", "numpy"):
            ap = kw.get("allow_pickle")
            if isinstance(ap, ast.Constant) and ap.value is True:
                found.append((node.lineno, f"{name}(allow_pickle=True)"))
    return found


def test_the_scanner_catches_unsafe_calls():
    bad = ("import pickle\nimport torch\nimport numpy as np\ntorch.load('x')\ntorch.load('x', weights_only=False)\n"
           "np.load('x', allow_pickle=True)\nimport pandas as pd\npd.read_pickle('x')\n")
    assert len(unsafe_calls(bad)) == 5
    assert unsafe_calls("import torch\ntorch.load('x', weights_only=True)\nimport numpy as np\nnp.load('x')\n") == []


def test_no_code_path_can_unpickle():
    problems = []
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            for line, why in unsafe_calls(f.read_text(encoding="utf-8")):
                problems.append(f"{f.relative_to(REPO)}:{line}: {why}")
    assert not problems, "\n".join(problems)

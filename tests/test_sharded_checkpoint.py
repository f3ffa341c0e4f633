"""FSDP2's sharded checkpoint (#27 item 3): each rank writes its own shards, nothing is gathered.

Three torchrun launches (2 gloo processes on CPU), shared by every test through one module fixture:
`ref`, uninterrupted, saved the old way (--no-fsdp-sharded-checkpoints: gathered to rank 0, one file),
the oracle; `run`, the same training stopped at step 4 and resumed to the end, saved sharded, through
this file's own entry point, which fails the run if a checkpoint save gathers anything.

    torchrun … tests/test_sharded_checkpoint.py TRAIN_ARGS   train.main; a checkpoint gather raises
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import preloaded  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from training.checkpoint import checkpoint_io as ckpt  # noqa: E402

STOP = 4  # the step the sharded run is stopped at and resumed from (the reference saves it too)
WORLD = 2
GATHERED = "a checkpoint save gathered the full state"


def shard_names(world: int = WORLD) -> set[str]:
    # the file names the requirement gives, spelled out (not through ckpt.shard_file, the code under test)
    return {f"{kind}.rank{r:05d}-of-{world:05d}.safetensors" for kind in ("model", "optim") for r in range(world)}


@pytest.fixture(scope="module")
def runs(bn_data: Path, tmp_path_factory) -> dict:
    from test_distributed import COMMON, _gloo_unsupported, torchrun

    root = tmp_path_factory.mktemp("sharded")
    args = [*COMMON, "--data", str(bn_data), "--batch-size", "4", "--fsdp", "--save-every", str(STOP)]
    ref = torchrun(HERE.parent / "training" / "train.py", *args, "--out", str(root / "ref"),
                   "--no-fsdp-sharded-checkpoints", check=False)
    if ref.returncode != 0 and (why := _gloo_unsupported(ref.stderr)):
        pytest.skip(f"FSDP2 on CPU: this torch's gloo backend lacks a collective: {why}")
    assert ref.returncode == 0, ref.stderr[-4000:]
    first = torchrun(Path(__file__), *args, "--out", str(root / "run"), "--stop-at", str(STOP))
    second = torchrun(Path(__file__), *args, "--out", str(root / "run"))
    return {"root": root, "ref": root / "ref", "run": root / "run", "first": first, "second": second}


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / ckpt.step_dir_name(step)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b) and a, (sorted(set(a) ^ set(b))[:5], len(a))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), (k, (a[k].float() - b[k].float()).abs().max().item())


def test_each_rank_writes_its_shards_and_the_resumed_run_is_bit_identical(runs: dict) -> None:
    run, ref = runs["run"], runs["ref"]
    assert GATHERED not in runs["first"].stderr + runs["second"].stderr
    assert "resumed from" in runs["second"].stdout
    for step in (STOP, 8):
        files = {f.name for f in step_dir(run, step).iterdir()}
        assert shard_names() <= files and "shards.json" in files, files
        assert not files & {"model.safetensors", "optim.safetensors"}, files  # nothing gathered into one file
        assert {"model.safetensors", "optim.safetensors"} <= {f.name for f in step_dir(ref, step).iterdir()}
    assert not list((run / "checkpoints").glob(ckpt.TMP_PREFIX + "*"))
    saves = [r for r in records(run) if r.get("event") == "checkpoint"]
    assert [r["step"] for r in saves] == [STOP, 8] and all(r.get("sharded") and r["async"] is False for r in saves), saves
    # the weights really are split: each rank holds a part of the embedding's rows
    index = json.loads((step_dir(run, 8) / "shards.json").read_text())
    assert len(index["model"]["tok_embeddings.weight"]["parts"]) == WORLD, index["model"]["tok_embeddings.weight"]
    # stopped and resumed == uninterrupted: the same losses, and bit-identical weights and optimizer state
    losses = [(r["step"], r["loss"]) for r in records(run) if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in records(ref) if "loss" in r] and len(losses) == 8
    a, b = ckpt.load(run), ckpt.load(ref)
    assert a.state["step"] == b.state["step"] == 8
    assert_same_tensors(a.weights, b.weights)
    assert_same_tensors(a.optimizer_and_rng(strict=True)[0], b.optimizer_and_rng(strict=True)[0])


def test_one_process_reads_the_sharded_checkpoint_as_the_gathered_one(runs: dict) -> None:
    """The oracle: the same training's step-4 checkpoint, gathered to rank 0 and written whole."""
    a, b = ckpt.load(runs["run"], STOP), ckpt.load(runs["ref"], STOP)
    assert ckpt.is_sharded(a.path) and not ckpt.is_sharded(b.path)
    assert_same_tensors(a.weights, b.weights)
    (ta, ra), (tb, rb) = a.optimizer_and_rng(strict=True), b.optimizer_and_rng(strict=True)
    assert_same_tensors(ta, tb)
    assert_same_tensors(ra, rb)
    assert a.state["optimizer_param_groups"] == b.state["optimizer_param_groups"]
    model, _ = ckpt.load_model(runs["run"], STOP)
    assert all(torch.equal(v, b.weights[k]) for k, v in model.state_dict().items() if k in b.weights)


def export(path: Path, out: Path, fmt: str = "safetensors") -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", "export", fmt, str(path), "--no-parity", "--out", str(out)],
                         capture_output=True, text=True, cwd=HERE.parent, timeout=300)


# what each export writes from the weights alone (its reports hold timings): equal bytes from either form
WEIGHT_FILES = {"safetensors": "*.safetensors", "gguf": "*.gguf", "onnx": "*.onnx_data"}


def weight_bytes(f: Path) -> dict[str, bytes]:
    """A file's weights: a GGUF's tensors (its metadata names the run folder), any other file whole."""
    if f.suffix != ".gguf":
        return {"": f.read_bytes()}
    from gguf import GGUFReader

    return {t.name: bytes(t.data) for t in GGUFReader(f).tensors}


@pytest.mark.parametrize("fmt", list(WEIGHT_FILES))
def test_export_reads_a_sharded_checkpoint(runs: dict, tmp_path: Path, fmt: str) -> None:
    got = {}
    for form in ("run", "ref"):  # the sharded run and the gathered reference, stopped at the same step
        out = tmp_path / form
        p = export(step_dir(runs[form], 8), out, fmt)
        assert p.returncode == 0, p.stderr[-3000:]
        # a GGUF's file name starts with the run folder's name: compare what follows it
        got[form] = {str(f.relative_to(out)).replace(runs[form].name, "RUN"): weight_bytes(f)
                     for f in sorted(out.rglob(WEIGHT_FILES[fmt]))}
    assert got["run"] and got["run"].keys() == got["ref"].keys()
    for rel in got["run"]:  # the same weights exported from either form of the same checkpoint
        assert got["run"][rel] == got["ref"][rel], rel


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_shard_is_refused_naming_the_file(runs: dict, tmp_path: Path, damage: str) -> None:
    copy = tmp_path / "step"
    shutil.copytree(step_dir(runs["run"], 8), copy)
    victim = copy / "model.rank00001-of-00002.safetensors"
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(copy)
    assert str(victim) in str(e.value) and "\n" not in str(e.value), e.value
    with pytest.raises(ckpt.CheckpointError, match=victim.name):
        ckpt.check_readable(copy)  # what a resume checks before it writes anything
    p = export(copy, tmp_path / "export")
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 1 and victim.name in errors[0], p.stderr[-2000:]
    assert not (tmp_path / "export").exists()  # nothing written


def test_a_single_process_resumes_a_sharded_checkpoint(runs: dict, bn_data: Path, tmp_path: Path) -> None:
    """Another world size reads the full assembly: one process resumes the 2-rank run's step 4."""
    from conftest import run_train
    from test_distributed import COMMON

    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    ckpt.remove(step_dir(run, 8))
    p = run_train(*COMMON, "--data", str(bn_data), "--out", str(run), "--batch-size", "4", "--max-steps", str(STOP + 1))
    assert f"resumed from {step_dir(run, STOP)}" in p.stdout, p.stdout[-2000:]
    assert ckpt.load(run).state["step"] == STOP + 1
    assert not ckpt.is_sharded(ckpt.latest(run))  # one process writes the one-file form


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 2048])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_row_split_is_torch_chunks(rows: int, parts: int) -> None:
    """FSDP2 shards dim 0 as torch.chunk does; ranks past the last chunk hold no rows."""
    from training.checkpoint.fsdp_shards import chunk_rows

    chunks = [c.tolist() for c in torch.arange(rows).chunk(parts)] if rows else []
    chunks += [[]] * (parts - len(chunks))
    got = [list(range(*chunk_rows(0, rows, parts, i))) for i in range(parts)]
    assert got == chunks


def test_uneven_shards_assemble_into_the_full_tensors(runs: dict, tmp_path: Path) -> None:
    """Three ranks over rows that do not divide evenly (2048 = 683 + 683 + 682; a 5-row tensor as 2 + 2 + 1),
    written by hand in the documented layout (shards.json: shape, dtype, [file, first row, end row] parts)."""
    from safetensors.torch import save_file

    world = 3
    src = ckpt.load(runs["ref"], 8)
    folder = tmp_path / "step"
    folder.mkdir()
    for f in ("config.json", "tokenizer.model", "state.json"):
        shutil.copy(src.path / f, folder / f)
    weights = {**src.weights, "extra.five_rows": torch.arange(15.0).reshape(5, 3)}
    files: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    entries = {}
    for name, t in weights.items():
        parts, row = [], 0
        for r, piece in enumerate(t.chunk(world)):
            files[r][name] = piece.contiguous()
            parts.append([f"model.rank{r:05d}-of-{world:05d}.safetensors", row, row + piece.shape[0]])
            row += piece.shape[0]
        entries[name] = {"shape": list(t.shape), "dtype": "float32", "parts": parts}
    names = []
    for r in range(world):
        for kind, tensors in (("model", files[r]), ("optim", {})):
            names.append(f"{kind}.rank{r:05d}-of-{world:05d}.safetensors")
            save_file(tensors, str(folder / names[-1]))
    (folder / "shards.json").write_text(json.dumps({"prodip_shards": 1, "world_size": world, "files": names,
                                                    "model": entries, "optim": {}}))
    assert [len(p) for p in (files[0]["extra.five_rows"], files[2]["extra.five_rows"])] == [2, 1]
    with ckpt.open_tensors(folder) as f:
        assert_same_tensors({k: f.get_tensor(k) for k in f.keys()}, weights)  # noqa: SIM118 (not a dict)
    entries["extra.five_rows"]["parts"].pop(1)  # rows 2..4 in no file: refused, naming the index
    (folder / "shards.json").write_text(json.dumps({"prodip_shards": 1, "world_size": world, "files": names,
                                                    "model": entries, "optim": {}}))
    with pytest.raises(ckpt.CheckpointError, match="shards.json.*extra.five_rows"), ckpt.open_tensors(folder) as f:
        f.get_tensor("extra.five_rows")


def _refuse_checkpoint_gathers() -> None:
    """A checkpoint save's gather (rank0_only=True; the pre-flight gates' own full copies are allowed) fails."""
    from training import distributed as D

    full_model, full_optim = D.full_model_state, D.full_optimizer_state

    def model_state(model, *, rank0_only: bool = False):
        if rank0_only:
            raise AssertionError(GATHERED)
        return full_model(model, rank0_only=rank0_only)

    def optim_state(*a, **k):
        raise AssertionError(GATHERED)

    D.full_model_state, D.full_optimizer_state = model_state, optim_state
    del full_optim


if __name__ == "__main__":
    import training.train as T

    torch.set_num_threads(1)
    _refuse_checkpoint_gathers()
    sys.exit(T.main(sys.argv[1:]))

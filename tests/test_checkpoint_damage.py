"""Checkpoints are checked on read, whoever reads them (#42 items 4 and 5): a damaged checkpoint is one
`error:` line naming the file and the field, a non-zero exit, and every file of the run byte-identical
afterwards, through a resume (train.py), an export and an evaluation alike.

The damage is what a disk, a hand edit or a bad copy makes: a step that is negative or not the step in
the folder's name (step_0000004), a counter that is NaN, inf or negative, a NaN in a weight, a
config.json whose vocab_size is the string "2048". Sharded (FSDP2) checkpoints are written here through
the writer's own functions from the tiny run's checkpoint, split in two ranks of equal shapes, so two
rank files swapped pass every shape check; shards.json's digests must refuse them by name.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fixtures_reliability import call_main, one_error, train_argv, tree_digest
from safetensors.torch import load_file, save_file

from training.checkpoint import checkpoint_io as ckpt

TEXT = sorted((Path(__file__).resolve().parents[1] / "training" / "assets" / "corpus").glob("*.txt"))[0]
STEP = 4  # rel_run's newest checkpoint: checkpoints/step_0000004
WORLD = 2


def _newest(run: Path) -> Path:
    return run / "checkpoints" / f"step_{STEP:07d}"  # spelled out: not through the code under test


def _state(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        f = _newest(run) / "state.json"
        d = json.loads(f.read_text())
        edit(d)
        f.write_text(json.dumps(d))  # json.dumps writes NaN and Infinity as Python's json reads them
    return damage


def _nan_weight(run: Path) -> None:
    f = _newest(run) / "model.safetensors"
    w = load_file(str(f))
    w["layers.0.attention.wq.weight"][3, 5] = float("nan")
    save_file(w, str(f), metadata={"format": "pt"})


def _config(key: str, value: object) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        f = _newest(run) / "config.json"
        d = json.loads(f.read_text())
        d[key] = value
        f.write_text(json.dumps(d))
    return damage


# damage -> (the file the error must name, the field it must name)
DAMAGE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "step -1": (_state(lambda d: d.update(step=-1)), "state.json", "step"),
    "step not the folder's": (_state(lambda d: d.update(step=2)), "state.json", "step"),
    "tokens NaN": (_state(lambda d: d.update(tokens=float("nan"))), "state.json", "tokens"),
    "tokens inf": (_state(lambda d: d.update(tokens=float("inf"))), "state.json", "tokens"),
    "tokens negative": (_state(lambda d: d.update(tokens=-5)), "state.json", "tokens"),
    "data position NaN": (_state(lambda d: d["data"].update(consumed=float("nan"))), "state.json", "consumed"),
    "a NaN in a weight": (_nan_weight, "model.safetensors", "layers.0.attention.wq.weight"),
    "config vocab_size a string": (_config("vocab_size", "2048"), "config.json", "vocab_size"),
    "config n_layers true": (_config("n_layers", True), "config.json", "n_layers"),
}

# how each stage reads the run (the module whose main() a user's command runs, and its arguments)
STAGES: dict[str, tuple[str, Callable[[Path, Path], list]]] = {
    "resume": ("training.train", lambda run, data: train_argv(data, run, steps=STEP + 2)[2:]),
    "export": ("export.__main__", lambda run, data: ["safetensors", run, "--no-parity"]),
    "evaluate": ("training.evaluate.evaluate_cli", lambda run, data: [run, "--text", TEXT, "--limit", "2", "--no-twin",
                                                             "--gen-tokens", "0"]),
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_error_and_changes_nothing(case, stage, rel_run, bn_data, tmp_path, capsys):
    damage, file, field = DAMAGE[case]
    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    damage(run)
    before = tree_digest(run)
    module, argv = STAGES[stage]
    line = one_error(*call_main(module, argv(run, bn_data), capsys), file)
    assert field in line, line
    assert tree_digest(run) == before  # run.json, log.jsonl, curves.png, the checkpoints: not one byte


def test_an_undamaged_copy_passes_the_same_reads(rel_run, tmp_path):
    """The control: the checks refuse the damage above, not the checkpoint itself."""
    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    ck = ckpt.load(run)
    assert ck.state["step"] == STEP and ck.config.vocab_size == 2048
    tensors, rng = ck.optimizer_and_rng(strict=True)
    assert tensors and rng


def test_nan_in_an_optimizer_moment_is_refused_unless_reset(rel_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    f = _newest(run) / "optim.safetensors"
    t = load_file(str(f))
    key = next(k for k in t if k.endswith("/exp_avg_sq"))
    t[key].view(-1)[0] = float("inf")
    save_file(t, str(f))
    with pytest.raises(ckpt.CheckpointError, match=rf"optim\.safetensors: {key} holds non-finite"):
        ckpt.load(run).optimizer_and_rng(strict=True)


# --------------------------------------------------------------------------------- sharded checkpoints
def _write_sharded(run: Path) -> Path:
    """Checkpoint STEP rewritten in the sharded form by the writer's functions, rows split across WORLD
    ranks as FSDP2 splits them (torch.chunk of dim 0): every rank file holds tensors of the same shapes."""
    ck = ckpt.load(run, STEP)
    optim_tensors, rng = ck.optimizer_and_rng(strict=True)
    shapes: dict = {"model": {}, "optim": {}}
    ranks: list[dict[str, dict]] = [{"model": {}, "optim": {}} for _ in range(WORLD)]
    for kind, tensors in (("model", ck.weights), ("optim", optim_tensors)):
        for name, t in tensors.items():
            if t.dim() == 0:  # AdamW's step counts: whole, in rank 0's file
                shapes[kind][name] = ([], t.dtype, None)
                ranks[0][kind][name] = t
                continue
            slices, row = [], 0
            for r, piece in enumerate(t.chunk(WORLD)):
                ranks[r][kind][name] = piece.contiguous()
                slices.append((r, row, row + piece.shape[0]))
                row += piece.shape[0]
            shapes[kind][name] = (list(t.shape), t.dtype, slices)
    index = ckpt.shard_index(WORLD, shapes, rng_names=list(rng))
    tmp = ckpt.begin_sharded(run, STEP)
    for r in range(WORLD):
        ckpt.write_shard(tmp, STEP, r, WORLD, weights=ranks[r]["model"], optim_tensors=ranks[r]["optim"],
                         rng=rng if r == 0 else None)
    return ckpt.commit_sharded(run, STEP, tmp, index=index, cfg=ck.config, tokenizer=ck.tokenizer, state=ck.state)


@pytest.fixture
def sharded_run(rel_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    c = _write_sharded(run)
    assert ckpt.is_sharded(c) and not (c / "model.safetensors").exists()
    return run


def _rank_file(run: Path, r: int) -> Path:
    return _newest(run) / f"model.rank{r:05d}-of-{WORLD:05d}.safetensors"


def test_a_sharded_checkpoint_reads_as_the_one_it_was_split_from(sharded_run, rel_run):
    """The control for the cases below: the digests recorded at write time match, the tensors are the same."""
    a, b = ckpt.load(sharded_run), ckpt.load(rel_run, STEP)
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    index = json.loads((_newest(sharded_run) / "shards.json").read_text())
    assert set(index["digests"]) == set(index["files"]) and len(index["files"]) == 2 * WORLD
    names = {p.name for p in _newest(sharded_run).iterdir()}  # the ranks' digest records are not left behind
    assert names == {*index["files"], "shards.json", "state.json", "config.json", "tokenizer.model"}, names
    heads = [{k: tuple(v.shape) for k, v in load_file(str(_rank_file(sharded_run, r))).items()} for r in range(WORLD)]
    assert heads[0] == heads[1], "the swap below must pass every shape check"


def test_two_rank_files_swapped_are_refused_by_name(sharded_run, bn_data, tmp_path, capsys):
    a, b = _rank_file(sharded_run, 0), _rank_file(sharded_run, 1)
    swap = tmp_path / "swap"
    a.rename(swap)
    b.rename(a)
    swap.rename(b)
    before = tree_digest(sharded_run)
    with pytest.raises(ckpt.CheckpointError, match=r"model\.rank0000[01]-of-00002\.safetensors: its sha256"):
        ckpt.load(sharded_run)
    line = one_error(*call_main("export.__main__", ["safetensors", sharded_run, "--no-parity"], capsys),
                     (a.name, b.name))
    assert "sha256" in line, line
    one_error(*call_main("training.train", train_argv(bn_data, sharded_run, steps=STEP + 2)[2:], capsys),
              (a.name, b.name))
    assert tree_digest(sharded_run) == before


@pytest.mark.parametrize("shape", [[10**12, 64], [2**70], [2048, -64], [True, 64], "2048"])
def test_an_absurd_shape_in_the_index_is_one_error(shape, sharded_run, capsys):
    index_file = _newest(sharded_run) / "shards.json"
    index = json.loads(index_file.read_text())
    index["model"]["tok_embeddings.weight"]["shape"] = shape
    index_file.write_text(json.dumps(index))
    before = tree_digest(sharded_run)
    line = one_error(*call_main("export.__main__", ["safetensors", sharded_run, "--no-parity"], capsys), "shards.json")
    assert "tok_embeddings.weight" in line, line
    assert tree_digest(sharded_run) == before


def test_a_shard_file_of_another_size_is_refused_before_it_is_read(sharded_run):
    f = _rank_file(sharded_run, 1)
    f.write_bytes(f.read_bytes() + b"\0" * 8)  # safetensors ignores trailing bytes; the recorded size does not
    with pytest.raises(ckpt.CheckpointError, match=rf"{f.name}: .* bytes, .*shards\.json recorded"):
        ckpt.check_readable(_newest(sharded_run))  # headers only: what a resume checks first


def test_an_index_without_digests_is_read_with_a_warning(sharded_run, capsys):
    """Written before the digests existed: accepted (docs/reliability.md says why), and said once."""
    index_file = _newest(sharded_run) / "shards.json"
    index = json.loads(index_file.read_text())
    del index["digests"]
    index_file.write_text(json.dumps(index))
    ckpt.load(sharded_run)
    ckpt.load(sharded_run)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "shards.json records no size or sha256" in err, err

"""training/checkpoint/checkpoint_format.py on hand-built folders and state dicts: which step_* folders a resume
sees and in what order, which one `resolve` picks, the optimizer state's flat form and back, the
file names. Expectations are written out from the format (step_0000012, model.rank00001-of-00002,
"name/moment"), never read back from the code. The fast tests of the `resume` mutation target."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import training.checkpoint.checkpoint_format as F


def step(run: Path, n: int | str, *files: str) -> Path:
    d = run / "checkpoints" / (n if isinstance(n, str) else f"step_{n:07d}")
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_text("x")
    return d


# ------------------------------------------------------------------------------------ names
def test_file_names_of_the_format() -> None:
    assert F.step_dir_name(12) == "step_0000012" and F.step_dir_name(1234567) == "step_1234567"
    assert F.shard_file("model", 1, 2) == "model.rank00001-of-00002.safetensors"
    assert F.shard_file("optim", 0, 16) == "optim.rank00000-of-00016.safetensors"
    assert (F.MODEL_FILE, F.OPTIM_FILE, F.STATE_FILE, F.CONFIG_FILE, F.TOKENIZER_FILE) == (
        "model.safetensors", "optim.safetensors", "state.json", "config.json", "tokenizer.model")
    assert F.SHARD_INDEX_FILE == "shards.json"
    resume_keys = {"step": int, "tokenizer_sha256": str, "tokens": int, "data": dict}
    assert resume_keys == F.RESUME_STATE_SCHEMA


def test_step_of_reads_only_step_folders() -> None:
    assert F.step_of(Path("run/checkpoints/step_0000012")) == 12
    assert F.step_of(Path("step_7")) == 7
    for name in ("step_", "step_12a", "xstep_12", ".tmp-step_12", "stp_12", "12", "step_-1"):
        assert F.step_of(Path(name)) is None, name


def test_has_weights_and_is_sharded(tmp_path: Path) -> None:
    assert not F.has_weights(tmp_path) and not F.is_sharded(tmp_path)
    (tmp_path / "shards.json").mkdir()  # a folder by that name is not the index
    assert not F.is_sharded(tmp_path) and not F.has_weights(tmp_path)
    (tmp_path / "shards.json").rmdir()
    (tmp_path / "shards.json").write_text("{}")
    assert F.is_sharded(tmp_path) and F.has_weights(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_text("x")
    assert F.has_weights(str(other)) and not F.is_sharded(str(other))  # a str is accepted too


# ------------------------------------------------------------------------------------ listing
def test_list_checkpoints_oldest_first_by_step_number(tmp_path: Path) -> None:
    assert F.list_checkpoints(tmp_path) == []  # no checkpoints folder at all
    (tmp_path / "checkpoints").mkdir()
    assert F.list_checkpoints(tmp_path) == [] and F.latest(tmp_path) is None
    # names that sort differently as text and as numbers; temporaries, files and other folders are not listed
    a, b, c = step(tmp_path, "step_10"), step(tmp_path, "step_9"), step(tmp_path, 100)
    step(tmp_path, ".tmp-step_0000200")
    step(tmp_path, "notes")
    (tmp_path / "checkpoints" / "step_0000300").write_text("a file, not a folder")
    assert F.list_checkpoints(tmp_path) == [b, a, c]
    assert F.list_checkpoints(str(tmp_path)) == [b, a, c]
    assert F.latest(tmp_path) == c


def test_remove_leaves_no_step_folder_behind(tmp_path: Path) -> None:
    a, b = step(tmp_path, 1, "model.safetensors"), step(tmp_path, 2)
    F.remove(b)
    assert not b.exists() and F.list_checkpoints(tmp_path) == [a]
    assert list((tmp_path / "checkpoints").iterdir()) == [a]  # the renamed copy was deleted too


def test_remove_renames_before_deleting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = step(tmp_path, 2, "model.safetensors")
    renamed: list[tuple[Path, Path]] = []
    monkeypatch.setattr(F.shutil, "rmtree", lambda p, ignore_errors: renamed.append((p, ignore_errors)))
    F.remove(b)
    doomed, ignore = renamed[0]
    assert doomed == b.with_name(f".tmp-del-step_0000002-{os.getpid()}") and doomed.is_dir() and ignore is True
    assert not b.exists() and F.list_checkpoints(tmp_path) == []


# ------------------------------------------------------------------------------------ resolve
def test_resolve_a_checkpoint_folder_itself(tmp_path: Path) -> None:
    c = step(tmp_path, 5, "model.safetensors", "config.json")
    assert F.resolve(c) == c and F.resolve(str(c), step=99) == c  # a folder itself: `step` is not consulted
    sharded = step(tmp_path, 6, "shards.json", "config.json")
    assert F.resolve(sharded) == sharded


def test_resolve_a_run_folder_to_its_latest_or_a_given_step(tmp_path: Path) -> None:
    a = step(tmp_path, 5, "model.safetensors", "config.json")
    b = step(tmp_path, 12, "model.safetensors", "config.json")
    assert F.resolve(tmp_path) == b and F.resolve(str(tmp_path)) == b
    assert F.resolve(tmp_path, step=5) == a
    with pytest.raises(F.CheckpointError, match=rf"^no checkpoint for step 7 in {tmp_path}$"):
        F.resolve(tmp_path, step=7)


def test_resolve_step_zero_is_a_step_not_absent(tmp_path: Path) -> None:
    zero = step(tmp_path, 0, "model.safetensors", "config.json")
    step(tmp_path, 3, "model.safetensors", "config.json")
    assert F.resolve(tmp_path, step=0) == zero


def test_resolve_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(F.CheckpointError, match=rf"^not found: {tmp_path / 'nope'}$"):
        F.resolve(tmp_path / "nope")
    with pytest.raises(F.CheckpointError, match=rf"^{tmp_path} holds no complete checkpoint \(expected a run "
                                               r"folder or a checkpoint folder\)$"):
        F.resolve(tmp_path)
    # weights without a config, or a config without weights, is not a checkpoint folder: looked up as a run
    (tmp_path / "model.safetensors").write_text("x")
    with pytest.raises(F.CheckpointError, match="holds no complete checkpoint"):
        F.resolve(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(F.CheckpointError, match="holds no complete checkpoint"):
        F.resolve(tmp_path)
    step(tmp_path, "step_0000004")  # a step folder name that is a file-less folder
    (tmp_path / "checkpoints" / "step_0000002").write_text("a file")
    with pytest.raises(F.CheckpointError, match="no checkpoint for step 2"):
        F.resolve(tmp_path, step=2)


# ------------------------------------------------------------------------------------ optimizer state
def test_flatten_optimizer_keys_moments_by_parameter_name() -> None:
    sd = {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}, 1: {"exp_avg": torch.zeros(1),
                                                                                  "step": 5}},
          "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.0, "params": [1]}]}
    tensors, groups = F.flatten_optimizer(sd, ["w", "b"])
    assert sorted(tensors) == ["b/exp_avg", "b/step", "w/exp_avg", "w/step"]
    assert torch.equal(tensors["w/exp_avg"], torch.ones(2)) and torch.equal(tensors["w/step"], torch.tensor(3.0))
    assert torch.is_tensor(tensors["b/step"]) and tensors["b/step"].item() == 5  # a plain number becomes a tensor
    assert groups == [{"lr": 0.1, "params": ["w"]}, {"lr": 0.0, "params": ["b"]}]
    assert sd["param_groups"][0]["params"] == [0]  # the input is not modified
    # name-keyed state (torch.distributed.checkpoint's full state dict) keeps its names
    named = {"state": {"w": {"exp_avg": torch.ones(1)}}, "param_groups": [{"lr": 1.0, "params": ["w"]}]}
    tensors, groups = F.flatten_optimizer(named, [])
    assert list(tensors) == ["w/exp_avg"] and groups == [{"lr": 1.0, "params": ["w"]}]


def test_flatten_optimizer_detaches_moments() -> None:
    x = torch.ones(2, requires_grad=True) * 2
    tensors, _ = F.flatten_optimizer({"state": {0: {"exp_avg": x}}, "param_groups": []}, ["w"])
    assert not tensors["w/exp_avg"].requires_grad


def test_unflatten_optimizer_is_the_inverse() -> None:
    tensors = {"layers.0.w/exp_avg": torch.ones(2), "layers.0.w/step": torch.tensor(3.0), "b/exp_avg": torch.zeros(1)}
    groups = [{"lr": 0.1, "params": ["layers.0.w"]}, {"lr": 0.0, "params": ["b"]}]
    sd = F.unflatten_optimizer(tensors, groups, ["b", "layers.0.w"])  # index-keyed, in parameter order
    assert set(sd["state"]) == {0, 1} and set(sd["state"][1]) == {"exp_avg", "step"}
    assert torch.equal(sd["state"][1]["exp_avg"], torch.ones(2)) and torch.equal(sd["state"][0]["exp_avg"], torch.zeros(1))
    assert sd["param_groups"] == [{"lr": 0.1, "params": [1]}, {"lr": 0.0, "params": [0]}]
    assert groups[0]["params"] == ["layers.0.w"]  # the input is not modified
    named = F.unflatten_optimizer(tensors, groups, None)  # name-keyed
    assert set(named["state"]) == {"layers.0.w", "b"} and named["param_groups"] == groups
    assert named["param_groups"][0] is not groups[0] and named["param_groups"][0]["params"] is not groups[0]["params"]


def test_an_optimizer_state_round_trips_through_the_flat_form() -> None:
    w, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [w], "lr": 0.1}, {"params": [b], "lr": 0.01}])
    (w.sum() * 2 + b.sum()).backward()
    opt.step()
    tensors, groups = F.flatten_optimizer(opt.state_dict(), ["w", "b"])
    back = F.unflatten_optimizer(tensors, groups, ["w", "b"])
    fresh = torch.optim.AdamW([{"params": [w], "lr": 0.1}, {"params": [b], "lr": 0.01}])
    fresh.load_state_dict(back)
    for i in (0, 1):
        for k, v in opt.state_dict()["state"][i].items():
            assert torch.equal(fresh.state_dict()["state"][i][k], v)


def test_flatten_optimizer_makes_no_copy_of_a_moment() -> None:
    # the writer copies each moment once, to the host; a copy here would double the optimizer's memory
    m = torch.ones(3)
    tensors, _ = F.flatten_optimizer({"state": {0: {"exp_avg": m}}, "param_groups": []}, ["w"])
    assert tensors["w/exp_avg"].data_ptr() == m.data_ptr()


def test_a_parameter_name_holding_a_slash_round_trips() -> None:
    # "name/moment": the moment is what follows the last slash, whatever the name holds
    sd = {"state": {0: {"exp_avg": torch.ones(1), "step": torch.tensor(2.0)}}, "param_groups": [{"params": [0]}]}
    tensors, groups = F.flatten_optimizer(sd, ["block/w"])
    assert sorted(tensors) == ["block/w/exp_avg", "block/w/step"]
    back = F.unflatten_optimizer(tensors, groups, ["block/w"])
    assert set(back["state"][0]) == {"exp_avg", "step"} and back["param_groups"] == [{"params": [0]}]
    named = F.unflatten_optimizer(tensors, groups, None)
    assert set(named["state"]) == {"block/w"}

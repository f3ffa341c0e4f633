"""The checkpoint readers in-process (issue #46 item 3, mutation target `checkpoint-read`): the read half of
training/checkpoint/checkpoint_io.py and training/checkpoint/checkpoint_verify.py, on checkpoints of an untrained tiny model
written here by the project's own writer (single-file and sharded over two "ranks"), then damaged one
way each. What a reader promises (checkpoint_verify's module doc, docs/reliability.md "Checkpoints and
run folders, checked"): every failure is one CheckpointError naming the file and the field; nothing is
unpickled (a pickle is called one); state.json's step is its folder's, its counters finite and in
range; config.json read strictly; no NaN/inf in weights or moments; a sharded checkpoint's files match
the size and sha256 its index recorded; weights and moments fit the model. test_checkpoint_damage.py
and test_sharded_checkpoint.py check the same on trained runs (minutes per mutant).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from training.checkpoint import checkpoint_io as C
from training.checkpoint import checkpoint_verify as V
from training.model.decoder import ModelConfig, Transformer
from training.text.tokenizer import train_tokenizer

SENTENCES = ["hello world this is a test", "আমি বাংলায় গান গাই"] * 50


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(SENTENCES, 300)


def config(vocab: int = 300, **kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": vocab, "d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                          "ffn_dim": 32, "max_seq_len": 16, **kw})


def weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return C.weights_for_save(Transformer(cfg).state_dict(), cfg)


def moments(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in w.items():
        out[f"{k}/exp_avg"], out[f"{k}/exp_avg_sq"], out[f"{k}/step"] = v * 0.1, v * v, torch.tensor(3.0)
    return out


RNG = {"torch_cpu": torch.get_rng_state()}


@pytest.fixture(scope="module")
def single(tmp_path_factory, tok) -> Path:
    """run/checkpoints/step_0000003: weights, moments, RNG, state (tokens, data position)."""
    run = tmp_path_factory.mktemp("single")
    cfg = config()
    w = weights(cfg)
    return C.save(run, 3, weights=w, cfg=cfg, tokenizer=tok, optim_tensors=moments(w), rng=RNG,
                  state={"tokens": 96, "elapsed_s": 1.5, "data": {"consumed": 96, "seq_len": 16, "epoch": 0}})


def copy(src: Path, tmp_path: Path, name: str | None = None) -> Path:
    dst = tmp_path / "run" / "checkpoints" / (name or src.name)
    shutil.copytree(src, dst)
    return dst


def err(fn, *args, **kw) -> str:
    with pytest.raises(C.CheckpointError) as e:
        fn(*args, **kw)
    return str(e.value)


# --------------------------------------------------------------------------- a whole checkpoint
def test_load_reads_back_what_was_written(single, tok):
    ck = C.load(single)
    cfg = config()
    assert ck.path == single and ck.config == cfg and ck.tokenizer.sha256 == tok.sha256
    assert ck.state["step"] == 3 and ck.state["tokens"] == 96 and ck.state["data"]["consumed"] == 96
    want = weights(cfg)
    assert set(ck.weights) == set(want) and all(torch.equal(ck.weights[k], want[k]) for k in want)
    model, ck2 = C.load_model(single.parent.parent, 3)  # a run folder and a step
    assert not model.training and ck2.path == single
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    assert torch.equal(model.state_dict()["output.weight"], want["tok_embeddings.weight"])  # tied


def test_optimizer_and_rng_split_by_prefix(single):
    ck = C.load(single)
    opt, rng = ck.optimizer_and_rng(strict=True)
    w = weights(config())
    assert set(opt) == set(moments(w)) and torch.equal(opt["norm.weight/exp_avg_sq"], w["norm.weight"] ** 2)
    assert set(rng) == {"torch_cpu"} and torch.equal(rng["torch_cpu"], RNG["torch_cpu"])
    C.check_optimizer_fits(list(Transformer(config()).named_parameters()), opt, rng, single)


def test_a_missing_optimizer_file_is_empty_unless_strict(single, tmp_path):
    c = copy(single, tmp_path)
    (c / "optim.safetensors").unlink()
    ck = C.load(c)
    assert ck.optimizer_and_rng() == ({}, {})
    assert err(ck.optimizer_and_rng, strict=True) == f"{c / 'optim.safetensors'}: optimizer state not found"
    C.check_readable(c)  # no optimizer file is readable: a weights-only checkpoint


def test_a_strict_read_needs_the_cpu_rng_state(single, tmp_path):
    c = copy(single, tmp_path)
    t = load_file(str(c / "optim.safetensors"))
    save_file({k: v for k, v in t.items() if not k.startswith("rng/")}, str(c / "optim.safetensors"))
    opt, rng = C.load(c).optimizer_and_rng()
    assert rng == {} and opt
    assert err(C.load(c).optimizer_and_rng, strict=True) == \
        f"{c / 'optim.safetensors'}: holds no RNG state (rng/torch_cpu)"


def test_a_nonfinite_moment_is_refused_naming_it(single, tmp_path):
    c = copy(single, tmp_path)
    t = load_file(str(c / "optim.safetensors"))
    t["norm.weight/exp_avg"][0] = float("nan")
    save_file(t, str(c / "optim.safetensors"))
    msg = err(C.load(c).optimizer_and_rng)
    assert msg.startswith(f"{c / 'optim.safetensors'}: norm.weight/exp_avg holds non-finite values")


@pytest.mark.parametrize("head", [b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"])
def test_a_pickle_is_named_and_never_unpickled(single, tmp_path, head):
    c = copy(single, tmp_path)
    (c / "model.safetensors").write_bytes(head + b"\x00" * 64)
    msg = err(C.load, c)
    assert msg.startswith(f"{c / 'model.safetensors'} is a pickle (torch.save) file, not safetensors; refused")
    assert "loading a pickle can run arbitrary code" in msg and msg.endswith("Re-save the tensors with safetensors")
    assert err(C.check_readable, c) == msg
    with pytest.raises(C.CheckpointError, match="is a pickle"), C.open_tensors(c):
        pass


def test_a_pickled_optimizer_file_is_named(single, tmp_path):
    c = copy(single, tmp_path)
    (c / "optim.safetensors").write_bytes(b"\x80\x04" + b"\x00" * 64)
    ck = C.load(c)
    assert err(ck.optimizer_and_rng).startswith(f"{c / 'optim.safetensors'} is a pickle")
    assert err(C.check_readable, c).startswith(f"{c / 'optim.safetensors'} is a pickle")


def test_a_truncated_file_is_named_with_safetensors_reason(single, tmp_path):
    c = copy(single, tmp_path)
    data = (c / "model.safetensors").read_bytes()
    (c / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = err(C.load, c)
    assert msg.startswith(f"{c / 'model.safetensors'}: truncated or corrupted safetensors file (") and msg.endswith(")")
    assert not msg.endswith("(None)")  # safetensors' own reason, for the user
    quick = err(C.check_readable, c)
    assert quick.startswith(f"{c / 'model.safetensors'}: truncated or corrupted safetensors file (")
    assert not quick.endswith("(None)")
    optim = tmp_path / "o" / "checkpoints" / single.name
    shutil.copytree(single, optim)
    data = (optim / "optim.safetensors").read_bytes()
    (optim / "optim.safetensors").write_bytes(data[: len(data) // 2])
    for m in (err(C.load(optim).optimizer_and_rng), err(C.check_readable, optim)):
        assert m.startswith(f"{optim / 'optim.safetensors'}: truncated or corrupted safetensors file (") and \
            not m.endswith("(None)")


def test_unreadable_tensors_of_a_file_that_cannot_be_opened(tmp_path):
    assert C.unreadable_tensors(tmp_path / "gone.safetensors", ValueError("x")) == \
        f"{tmp_path / 'gone.safetensors'}: truncated or corrupted safetensors file (x)"


def test_missing_weights_are_named(single, tmp_path):
    c = copy(single, tmp_path)
    (c / "model.safetensors").unlink()
    assert err(C.load, c).startswith(f"{c} holds no complete checkpoint")  # resolve() refuses it first


def test_nan_in_the_weights_is_refused(single, tmp_path):
    c = copy(single, tmp_path)
    t = load_file(str(c / "model.safetensors"))
    t["norm.weight"][1] = float("inf")
    save_file(t, str(c / "model.safetensors"))
    assert err(C.load, c).startswith(f"{c / 'model.safetensors'}: norm.weight holds non-finite values (NaN or inf)")


def test_the_tokenizer_must_be_the_models(single, tmp_path, tok):
    c = copy(single, tmp_path)
    train_tokenizer(SENTENCES, 310).save(c / "tokenizer.model")
    assert err(C.load, c) == f"{c}: tokenizer has 310 tokens but the model's vocab_size is 300"
    other = copy(single, tmp_path, "step_0000004")
    train_tokenizer([s + " x" for s in SENTENCES], 300).save(other / "tokenizer.model")
    state = json.loads((other / "state.json").read_text())
    (other / "state.json").write_text(json.dumps({**state, "step": 4}))
    assert err(C.load, other) == f"{other}: tokenizer.model does not match the tokenizer the weights were trained with"
    (other / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "tokenizer_sha256"} | {"step": 4}))
    with pytest.raises(C.CheckpointError, match="tokenizer_sha256"):  # required by the schema
        C.load(other)


def test_a_bare_folder_without_state_loads(single, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(single, bare)
    (bare / "state.json").unlink()
    (bare / "optim.safetensors").unlink()
    assert C.load(bare).state == {}
    step_dir = copy(single, tmp_path)  # a run's step folder must hold its state.json
    (step_dir / "state.json").unlink()
    assert "state.json" in err(C.load, step_dir)


def test_weights_that_do_not_fit_the_config_are_named(single, tmp_path):
    c = copy(single, tmp_path)
    t = load_file(str(c / "model.safetensors"))
    save_file({**t, "extra.weight": torch.zeros(1)}, str(c / "model.safetensors"))
    assert "unexpected ['extra.weight']" in err(C.load, c)
    save_file({k: v for k, v in t.items() if k != "norm.weight"}, str(c / "model.safetensors"))
    assert "missing ['norm.weight']" in err(C.load, c)
    save_file({**t, "norm.weight": torch.zeros(17)}, str(c / "model.safetensors"))
    msg = err(C.load, c)
    assert msg == (f"{c / 'model.safetensors'}: weights do not fit the model: missing [], unexpected [], "
                   "wrong shape ['norm.weight']")
    save_file({**t, "norm.weight": torch.zeros(16, dtype=torch.int32)}, str(c / "model.safetensors"))
    assert err(C.load, c) == f"{c / 'model.safetensors'}: weights are not floating point: norm.weight is torch.int32"
    save_file({**t, "output.weight": t["tok_embeddings.weight"].clone()}, str(c / "model.safetensors"))
    C.load(c)  # a tied head stored anyway is accepted


def test_check_fits_an_untied_model_needs_its_head(tmp_path):
    cfg = config(tie_embeddings=False)
    model = Transformer(cfg)
    full = dict(model.state_dict())
    V.check_fits(model, full, tmp_path)
    assert "missing ['output.weight']" in err(V.check_fits, model, {k: v for k, v in full.items() if k != "output.weight"},
                                              tmp_path)
    plain = torch.nn.Linear(2, 2)  # a module with no cfg: nothing is tied
    V.check_fits(plain, dict(plain.state_dict()), tmp_path)

    class Head(torch.nn.Module):  # no cfg, a head named like the tied one: it is required all the same
        def __init__(self) -> None:
            super().__init__()
            self.output = torch.nn.Linear(2, 2)

    head = Head()
    assert "missing ['output.weight']" in err(V.check_fits, head, {"output.bias": head.output.bias}, tmp_path)


def test_load_weights_allows_only_the_tied_head_missing():
    tied = Transformer(config())
    w = weights(config())
    C.load_weights(tied, w)
    assert err(C.load_weights, tied, {k: v for k, v in w.items() if k != "norm.weight"}) == \
        "weights do not fit the model: missing ['norm.weight'], unexpected []"
    assert err(C.load_weights, tied, {**w, "x": torch.zeros(1)}) == \
        "weights do not fit the model: missing [], unexpected ['x']"
    untied = Transformer(config(tie_embeddings=False))
    assert err(C.load_weights, untied, w) == "weights do not fit the model: missing ['output.weight'], unexpected []"


def test_open_tensors_and_check_readable_on_a_single_file(single):
    with C.open_tensors(single) as f:
        assert set(f.keys()) == set(weights(config()))
    C.check_readable(single)


# --------------------------------------------------------------------------- state.json and config.json
def state_of(c: Path, **change) -> None:
    s = json.loads((c / "state.json").read_text())
    (c / "state.json").write_text(json.dumps({**s, **change}))


@pytest.mark.parametrize(("change", "error"), [
    ({"step": 4}, "step = 4 is not the step in its folder's name step_0000003"),
    ({"tokens": -1}, "tokens = -1"), ({"elapsed_s": -0.5}, "elapsed_s = -0.5"), ({"world_size": 0}, "world_size = 0"),
    ({"tokens": 2**63}, "tokens = 9223372036854775808"), ({"tokens": 1.0}, "tokens = 1.0"),
    ({"data": {"consumed": -1}}, "data.consumed = -1"), ({"data": {"seq_len": 0}}, "data.seq_len = 0"),
    ({"early_stop": {"step": 4}}, "early_stop.step = 4 is after the checkpoint's step 3"),
    ({"early_stop": {"evals_since": -1}}, "early_stop.evals_since = -1"),
    ({"elapsed_s": float("nan")}, "elapsed_s is not a finite number"),
    ({"data": {"x": [1.0, float("inf")]}}, "data.x[1] is not a finite number"),
])
def test_a_damaged_state_is_one_error_naming_the_field(single, tmp_path, change, error):
    c = copy(single, tmp_path)
    state_of(c, **change)
    msg = err(C.read_state, c)
    assert f"{c / 'state.json'}: {error}" in msg, msg


def test_a_state_in_range_is_read(single, tmp_path):
    c = copy(single, tmp_path)
    state_of(c, early_stop={"step": 3, "evals_since": 0, "val_loss": None}, world_size=1, tokens=2**63 - 1)
    assert C.read_state(c)["early_stop"]["step"] == 3
    state_of(c, early_stop={"evals_since": 1}, data="not a dict")  # sections of another type: not read here
    C.read_state(c)
    assert C.read_state(c, required={"tokens": int})["tokens"] == 2**63 - 1
    with pytest.raises(C.CheckpointError, match="lacks 'nope'"):
        C.read_state(c, required={"nope": int})


def test_first_nonfinite_names_the_path():
    assert V.first_nonfinite({"a": {"b": [1.0, 2.0, float("nan")]}}) == "a.b[2]"
    assert V.first_nonfinite(float("-inf")) == "(the value)"
    assert V.first_nonfinite([{"x": 1}, {"y": float("inf")}]) == "[1].y"
    assert V.first_nonfinite({"a": [1, "nan", None, True]}) is None


@pytest.mark.parametrize(("change", "error"), [
    ({"vocab_size": "300"}, "vocab_size = '300'"), ({"d_model": 16.0}, "d_model = 16.0"),
    ({"n_heads": 3}, "not a valid model config"), ({"colour": 1}, "unknown model config key 'colour'; known: "),
])
def test_a_damaged_config_is_one_error_naming_the_file(single, tmp_path, change, error):
    c = copy(single, tmp_path)
    d = json.loads((c / "config.json").read_text())
    (c / "config.json").write_text(json.dumps({**d, **change}))
    msg = err(C.read_config, c)
    assert msg.startswith(f"{c / 'config.json'}: {error}" if "=" not in error and "valid" not in error
                          else str(c / "config.json")) and error in msg, msg


def test_a_config_missing_a_field_is_refused(single, tmp_path):
    c = copy(single, tmp_path)
    d = json.loads((c / "config.json").read_text())
    del d["norm_eps"]
    (c / "config.json").write_text(json.dumps(d))
    assert err(C.read_config, c) == f"{c / 'config.json'}: model config lacks 'norm_eps' (damaged, or not a prodip checkpoint?)"
    (c / "config.json").write_text("[1]")
    assert err(C.read_config, c).startswith(f"{c / 'config.json'}: model config must hold a JSON object")


def test_strict_model_config_names_a_bare_error_with_the_file(tmp_path):
    d = config().to_dict()
    assert V.strict_model_config(dict(d), tmp_path) == config()
    msg = err(V.strict_model_config, {**d, "n_heads": 3}, tmp_path / "config.json")
    assert msg.startswith(f"{tmp_path / 'config.json'}: not a valid model config (")


# --------------------------------------------------------------------------- optimizer state against the model
def test_check_optimizer_fits():
    model = Transformer(config())
    params = list(model.named_parameters())
    w = {k: v.detach() for k, v in params}
    full = moments(w)
    V.check_optimizer_fits(params, full, RNG, Path("c"))
    V.check_optimizer_fits(params, {}, RNG, Path("c"))  # no state yet: AdamW makes it at the first update
    last = params[-1][0]  # a parameter with no state yet does not end the check of the ones after it
    later_bad = {k: v for k, v in full.items() if not k.startswith(f"{params[0][0]}/") and k != f"{last}/exp_avg"}
    assert err(V.check_optimizer_fits, params, later_bad, RNG, Path("c")) == f"c: no optimizer state {last}/exp_avg"
    name = params[0][0]
    assert err(V.check_optimizer_fits, params, {k: v for k, v in full.items() if k != f"{name}/exp_avg_sq"}, RNG,
               Path("c")) == f"c: no optimizer state {name}/exp_avg_sq"
    assert err(V.check_optimizer_fits, params, {**full, f"{name}/step": torch.tensor(3)}, RNG, Path("c")) == \
        f"c: optimizer state {name}/step is torch.int64, not floating point"
    shape = tuple(params[0][1].shape)
    assert err(V.check_optimizer_fits, params, {**full, f"{name}/exp_avg": torch.zeros(2)}, RNG, Path("c")) == \
        f"c: optimizer state {name}/exp_avg has shape (2,), the parameter {shape}"
    V.check_optimizer_fits(params, {**full, f"{name}/step": torch.zeros(1)}, RNG, Path("c"))  # step: any shape
    for rng in ({}, {"torch_cpu": RNG["torch_cpu"].float()}, {"torch_cpu": RNG["torch_cpu"][:-1]}):
        assert err(V.check_optimizer_fits, params, full, rng, Path("c")) == "c: damaged RNG state rng/torch_cpu"


# --------------------------------------------------------------------------- sharded checkpoints
@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tok) -> Path:
    """step_0000005 written by two "ranks", each holding half the rows of every weight and moment."""
    run = tmp_path_factory.mktemp("sharded")
    cfg = config()
    w = weights(cfg)
    m = moments(w)
    tmp = C.begin_sharded(run, 5)
    layout_: dict = {"model": {}, "optim": {}}
    for kind, tensors in (("model", w), ("optim", m)):
        for k, v in tensors.items():
            if v.dim() == 0:
                layout_[kind][k] = (list(v.shape), v.dtype, None)
            else:
                half = v.shape[0] // 2
                layout_[kind][k] = (list(v.shape), v.dtype, [(0, 0, half), (1, half, v.shape[0])])
    for rank in (0, 1):
        def part(tensors, kind, rank=rank):
            out = {}
            for k, v in tensors.items():
                _, _, slices = layout_[kind][k]
                if slices is None:
                    if rank == 0:
                        out[k] = v
                else:
                    _, lo, hi = slices[rank]
                    out[k] = v[lo:hi].clone()
            return out
        C.write_shard(tmp, 5, rank, 2, weights=part(w, "model"), optim_tensors=part(m, "optim"),
                      rng=RNG if rank == 0 else None)
    index = C.shard_index(2, layout_, rng_names=list(RNG))
    return C.commit_sharded(run, 5, tmp, index=index, cfg=cfg, tokenizer=tok, state={"tokens": 5})


def index_of(c: Path) -> dict:
    return json.loads((c / "shards.json").read_text())


def write_index(c: Path, index: dict) -> None:
    (c / "shards.json").write_text(json.dumps(index))


def test_a_sharded_checkpoint_reads_as_the_whole_one(sharded):
    ck = C.load(sharded)
    want = weights(config())
    assert set(ck.weights) == set(want) and all(torch.equal(ck.weights[k], want[k]) for k in want)
    opt, rng = ck.optimizer_and_rng(strict=True)
    assert set(opt) == set(moments(want)) and torch.equal(opt["norm.weight/exp_avg"], want["norm.weight"] * 0.1)
    assert torch.equal(rng["torch_cpu"], RNG["torch_cpu"]) and opt["norm.weight/step"].item() == 3.0
    with C.open_tensors(sharded) as r:
        assert r.keys() == list(index_of(sharded)["model"])
        assert torch.equal(r.get_tensor("norm.weight"), want["norm.weight"])
    C.check_readable(sharded)


def test_a_missing_or_resized_shard_file_is_named_before_reading(sharded, tmp_path):
    c = copy(sharded, tmp_path)
    f = c / "model.rank00001-of-00002.safetensors"
    f.write_bytes(f.read_bytes() + b"\x00")
    msg = err(C.check_readable, c)
    assert msg == (f"{f}: {f.stat().st_size} bytes, {c / 'shards.json'} recorded {f.stat().st_size - 1} when it was "
                   "written (truncated, or replaced since)")
    f.unlink()
    assert err(C.load, c) == f"{f}: shard file not found (listed in {c / 'shards.json'})"


def test_a_changed_byte_of_the_same_size_fails_its_sha256(sharded, tmp_path):
    c = copy(sharded, tmp_path)
    f = c / "model.rank00000-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1  # the last byte of the payload: the header still reads
    f.write_bytes(bytes(data))
    C.check_readable(c)  # headers and sizes only
    msg = err(C.load, c)
    assert msg == (f"{f}: its sha256 is not the one {c / 'shards.json'} recorded when it was written (another "
                   "rank's file, or changed since); the checkpoint is damaged")


def test_a_file_is_hashed_once_per_reader(sharded, monkeypatch):
    calls = []
    real = C.check_digest
    monkeypatch.setattr(C, "check_digest", lambda *a: calls.append(a[0].name) or real(*a))
    with C.ShardedReader(sharded, "model") as r:
        names = r.keys()  # ShardedReader has no __iter__
        for k in names:
            r.get_tensor(k)
    assert sorted(calls) == ["model.rank00000-of-00002.safetensors", "model.rank00001-of-00002.safetensors"]


def test_an_index_without_digests_is_read_by_shape_with_one_warning(sharded, tmp_path, capsys):
    c = copy(sharded, tmp_path)
    index = index_of(c)
    del index["digests"]
    write_index(c, index)
    assert torch.equal(C.load(c).weights["norm.weight"], weights(config())["norm.weight"])
    C.load(c)
    err_out = capsys.readouterr().err
    assert err_out.count("records no size or sha256 per shard file") == 1 and str(c / "shards.json") in err_out
    assert "(written by an older prodip); its files are checked by shape only\n" in err_out  # what is given up


def rename_file(index: dict, name: str) -> None:
    """The last listed file under another name, in 'files' and 'digests' alike."""
    old = index["files"][-1]
    index["files"][-1] = name
    index["digests"][name] = index["digests"].pop(old)


@pytest.mark.parametrize(("damage", "error"), [
    (lambda ix: ix.update(prodip_shards=2), "shard format 2, this prodip reads 1"),
    (lambda ix: ix.pop("files"), "shards.json: checkpoint shard index "),
    (lambda ix: rename_file(ix, "../x.safetensors"), "'../x.safetensors' is not a shard file name"),
    (lambda ix: rename_file(ix, "x.bin"), "'x.bin' is not a shard file name"),
    (lambda ix: ix.update(files=[*ix["files"][:-1], 5]), "5 is not a shard file name"),
    (lambda ix: ix.update(digests={}), "'digests' must name each file of 'files' once"),
    (lambda ix: ix.update(digests=[1]), "'digests' must name each file of 'files' once"),
    (lambda ix: ix["digests"][ix["files"][0]].pop("sha256"), 'must be {"size", "sha256"}'),
    (lambda ix: ix["digests"].update({ix["files"][0]: 5}), 'must be {"size", "sha256"}'),
    (lambda ix: ix["digests"][ix["files"][0]].update(sha256="0" * 63), "sha256"),
    (lambda ix: ix["digests"][ix["files"][0]].update(size=-1), "digests.model.rank00000-of-00002.safetensors.size = -1"),
    (lambda ix: ix.pop("optim"), "optim"),
])
def test_a_damaged_index_is_one_error_naming_it(sharded, tmp_path, damage, error):
    c = copy(sharded, tmp_path)
    index = index_of(c)
    damage(index)
    write_index(c, index)
    msg = err(C.check_readable, c)
    assert str(c / "shards.json") in msg and error in msg, msg


@pytest.mark.parametrize(("damage", "error"), [
    (lambda e: e.update(dtype="int7"), "damaged entry"),
    (lambda e: e.update(parts=[]), "damaged entry"),
    (lambda e: e.update(parts=[["a", 0]]), "damaged entry"),
    (lambda e: e.pop("shape"), "damaged entry"),
    (lambda e: e.update(shape=[16, -1]), "damaged shape [16, -1]"),
    (lambda e: e.update(shape="16"), "damaged shape '16'"),
    (lambda e: e.update(shape=[]), "damaged shape []"),
    (lambda e: e.update(shape=[16.0]), "damaged shape [16.0]"),
    (lambda e: e["parts"][1].__setitem__(1, 9), "rows 9..16 do not continue rows 0..8 of 16"),
    (lambda e: e["parts"][1].__setitem__(2, 17), "rows 8..17 do not continue rows 0..8 of 16"),
    (lambda e: e["parts"][1].__setitem__(2, 8), "rows 8..8 do not continue rows 0..8 of 16"),
    (lambda e: e["parts"][0].__setitem__(2, 8.0), "rows 0..8.0 do not continue rows 0..0 of 16"),
    (lambda e: e.update(parts=e["parts"][:1]), "rows 8..16 are in no shard file"),
    (lambda e: e.update(shape=[16, 2]), "norm.weight is [8], "),
    (lambda e: e.update(dtype="float16"), "norm.weight is torch.float32, "),
    (lambda e: e["parts"][1].__setitem__(0, "other.safetensors"), "norm.weight is in 'other.safetensors', which the index does not list"),
    (lambda e: e["parts"].append([e["parts"][0][0], None, None]), "norm.weight is torch.float32 [8], "),
])
def test_a_damaged_tensor_entry_is_one_error_naming_it(sharded, tmp_path, damage, error):
    c = copy(sharded, tmp_path)
    index = index_of(c)
    damage(index["model"]["norm.weight"])
    write_index(c, index)
    msg = err(C.load, c)
    assert error in msg and "norm.weight" in msg, msg


def test_a_whole_tensor_of_another_shape_or_dtype_is_refused(sharded, tmp_path):
    c = copy(sharded, tmp_path)
    index = index_of(c)
    name = "rng/torch_cpu"
    index["optim"][name]["shape"] = [3]
    write_index(c, index)
    msg = err(C.load(c).optimizer_and_rng)
    assert msg.startswith(f"{c / 'optim.rank00000-of-00002.safetensors'}: {name} is torch.uint8 [") and \
        msg.endswith(f"{c / 'shards.json'} says torch.uint8 [3]")
    index["optim"][name].update(shape=None, dtype="float32")
    write_index(c, index)
    assert "says torch.float32 None" in err(C.load(c).optimizer_and_rng)
    index["optim"][name]["dtype"] = "uint8"
    index["optim"]["norm.weight/step"]["parts"] = [["optim.rank00001-of-00002.safetensors", None, None]]
    write_index(c, index)
    index["optim"]["norm.weight/exp_avg"]["parts"] = [["other.safetensors", None, None]]
    write_index(c, index)
    with C.ShardedReader(c, "optim") as r:
        assert err(r.get_tensor, "norm.weight/exp_avg").endswith(
            "norm.weight/exp_avg is in 'other.safetensors', which the index does not list")
        assert torch.equal(r.get_tensor(name), RNG["torch_cpu"])  # shape None: any
        assert "lists no tensor nope" in err(r.get_tensor, "nope")
        assert "cannot read norm.weight/step" in err(r.get_tensor, "norm.weight/step")


def test_a_sharded_checkpoint_without_optimizer_state(sharded, tmp_path):
    c = copy(sharded, tmp_path)
    index = index_of(c)
    index["optim"] = {}
    write_index(c, index)
    assert C.load(c).optimizer_and_rng() == ({}, {})
    assert err(C.load(c).optimizer_and_rng, strict=True) == f"{c / 'shards.json'}: optimizer state not found"


def test_a_shard_file_that_is_no_safetensors_is_named(sharded, tmp_path):
    c = copy(sharded, tmp_path)
    index = index_of(c)
    f = c / index["files"][1]
    f.write_bytes(b"\x80\x04" + b"\x00" * 10)
    del index["digests"]
    write_index(c, index)
    assert err(C.check_readable, c).startswith(f"{f} is a pickle")


def test_the_reader_closes_what_it_opened_when_a_later_file_fails(sharded, tmp_path, monkeypatch):
    c = copy(sharded, tmp_path)
    (c / index_of(c)["files"][-1]).unlink()
    closed = []
    real = C.contextlib.ExitStack.close
    monkeypatch.setattr(C.contextlib.ExitStack, "close", lambda self: closed.append(1) or real(self))
    err(C.ShardedReader, c, "model")
    assert closed


def test_a_part_in_a_file_that_is_no_name_is_one_error(sharded, tmp_path):
    c = copy(sharded, tmp_path)
    index = index_of(c)
    index["model"]["norm.weight"]["parts"][1][0] = ["x"]  # not even a string: still one CheckpointError
    write_index(c, index)
    assert "['x']" in err(C.load, c)


def test_parts_are_assembled_in_row_order_whatever_their_files_are_named(sharded, tmp_path):
    """The index lists each tensor's parts by rows; the files' names (ranks) need not follow the rows."""
    c = copy(sharded, tmp_path)
    index = index_of(c)
    a, b = "model.rank00000-of-00002.safetensors", "model.rank00001-of-00002.safetensors"
    (c / a).rename(c / "tmp"), (c / b).rename(c / a), (c / "tmp").rename(c / b)  # rank 1's rows under rank 0's name
    swap = {a: b, b: a}
    index["digests"] = {swap.get(k, k): v for k, v in index["digests"].items()}
    for e in index["model"].values():
        e["parts"] = [[swap.get(f, f), lo, hi] for f, lo, hi in reversed(e["parts"])]  # listed last rows first
    write_index(c, index)
    want = weights(config())
    got = C.load(c).weights
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_load_model_reads_the_step_asked_for_onto_the_device_asked_for(single, tmp_path):
    run = tmp_path / "run"
    copy(single, tmp_path)
    later = copy(single, tmp_path, "step_0000004")
    state_of(later, step=4)
    t = load_file(str(later / "model.safetensors"))
    save_file({k: v + 1 for k, v in t.items()}, str(later / "model.safetensors"))
    model, ck = C.load_model(run, 3)
    assert ck.state["step"] == 3 and torch.equal(model.state_dict()["norm.weight"], weights(config())["norm.weight"])
    assert C.load_model(run)[1].state["step"] == 4  # no step: the latest
    meta, _ = C.load_model(run, 3, device="meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}


def test_the_state_format_version_is_checked_and_named(single, tmp_path):
    c = copy(single, tmp_path)
    state_of(c, prodip_format=2)
    assert err(C.read_state, c).startswith(f"{c / 'state.json'}: checkpoint state format version 2")


def test_the_remedy_is_named_with_the_damage(single, tmp_path):
    c = copy(single, tmp_path)
    state_of(c, step=4)
    assert err(C.read_state, c).endswith("a damaged or renamed checkpoint: delete that folder to resume from the one before")
    t = load_file(str(c / "model.safetensors"))
    t["norm.weight"][0] = float("nan")
    save_file(t, str(c / "model.safetensors"))
    state_of(c, step=3)
    assert err(C.load, c).endswith("the checkpoint is damaged (delete that folder to resume from the one before)")


def test_an_early_stop_record_without_a_step_fits_step_0(single, tmp_path):
    c = copy(single, tmp_path, "step_0000000")
    state_of(c, step=0, early_stop={"evals_since": 1})
    assert C.read_state(c)["step"] == 0


def test_a_sharded_checkpoints_faults_name_its_index(sharded, tmp_path):
    c = copy(sharded, tmp_path)
    index = index_of(c)
    del index["model"]["norm.weight"]
    write_index(c, index)
    assert err(C.load, c).startswith(f"{c / 'shards.json'}: weights do not fit the model: missing ['norm.weight']")
    c2 = copy(sharded, tmp_path, "step_0000005b")
    index = index_of(c2)
    del index["digests"]
    write_index(c2, index)
    f = c2 / "model.rank00000-of-00002.safetensors"
    t = load_file(str(f))
    t["norm.weight"][0] = float("nan")
    save_file(t, str(f), metadata={"format": "pt"})
    assert err(C.load, c2).startswith(f"{c2 / 'shards.json'}: norm.weight holds non-finite values")
    f.write_bytes(f.read_bytes()[:100])  # truncated: safetensors' own reason, named
    msg = err(C.check_readable, c2)
    assert msg.startswith(f"{f}: truncated or corrupted safetensors file (") and not msg.endswith("(None)")

"""The training configuration schema: every flag, --set value, --config key and preset passes through
one schema (training.train_config.TrainConfig + training.model.decoder.ModelConfig, typed by training.runfiles.schema).

Bad input, run in-process through `training.train.main(argv)` (and a few through training/sft.py):
exit 2, exactly one `error:` line that names the flag, key or file and the value, no traceback, and
nothing written (the --out folder is not created; an existing one is byte-identical). Valid input
(TOML files and paths with spaces and Bangla letters) still parses, the precedence is
preset < --config < flags < --set, and the presets read from TOML are the shapes they always were.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import preloaded
import pytest
from conftest import REPO

from training import sft
from training import train as T
from training import train_config as C
from training.model.decoder import PRESETS, ModelConfig, preset, preset_names, preset_tables
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.schema import PositiveInt, SchemaError, flag

BASE = ["--preset", "tiny", "--max-steps", "2", "--device", "cpu", "--batch-size", "2", "--seq-len", "32"]

# (id, extra argv, what the one error line must contain): the flag or key, and the value
FLAG_CASES = [
    ("set-not-int", ["--set", "n_layers=abc"], ["--set n_layers", "'abc'", "valid integer"]),
    ("set-float-for-int", ["--set", "n_layers=1e3"], ["--set n_layers", "'1e3'"]),
    ("set-zero-heads", ["--set", "n_heads=0"], ["--set n_heads", "'0'", "greater than 0"]),
    ("set-heads-not-dividing", ["--set", "n_heads=3"], ["--set n_heads = 3", "divisible"]),
    ("set-huge-layers", ["--set", "n_layers=1000000000"], ["--set n_layers", "1000000000"]),
    ("set-unknown", ["--set", "nosuch=1"], ["--set nosuch", "unknown key 'nosuch'"]),
    ("set-near-miss", ["--set", "n_layer=2"], ["--set n_layer", "did you mean 'n_layers'"]),
    ("set-no-value", ["--set", "n_layers"], ["--set 'n_layers'", "KEY=VALUE"]),
    ("set-train-key", ["--set", "lr=fast"], ["--set lr", "'fast'"]),
    ("set-nan-eps", ["--set", "norm_eps=nan"], ["--set norm_eps", "'nan'", "finite"]),
    ("preset-unknown", ["--preset", "nosuchpreset"], ["--preset", "'nosuchpreset'", "unknown preset"]),
    ("preset-near-miss", ["--preset", "smal"], ["--preset", "did you mean 'small'"]),
    ("lr-nan", ["--lr", "nan"], ["--lr", "'nan'", "finite"]),
    ("lr-minus-inf", ["--lr=-inf"], ["--lr", "'-inf'"]),
    ("lr-zero", ["--lr", "0"], ["--lr", "'0'", "greater than 0"]),
    ("batch-zero", ["--batch-size", "0"], ["--batch-size", "'0'"]),
    ("batch-huge", ["--batch-size", str(10**30)], ["--batch-size", str(10**30)]),
    ("steps-not-int", ["--max-steps", "abc"], ["--max-steps", "'abc'"]),
    ("warmup-fraction", ["--warmup-steps", "1.5"], ["--warmup-steps", "'1.5'"]),
    ("seed-negative", ["--seed", "-1"], ["--seed", "'-1'"]),
    ("seed-too-big", ["--seed", str(2**64)], ["--seed", str(2**64)]),
    ("beta-one", ["--beta2", "1.0"], ["--beta2", "'1.0'", "less than 1"]),
    ("min-lr-ratio-above-one", ["--min-lr-ratio", "2"], ["--min-lr-ratio", "'2'"]),
    ("dtype-unknown", ["--dtype", "bogus"], ["--dtype", "'bogus'"]),
    ("device-unknown", ["--device", "gpu"], ["--device", "'gpu'"]),
    ("schedule-unknown", ["--schedule", "zigzag"], ["--schedule", "'zigzag'"]),
    ("on-spike-unknown", ["--on-spike", "panic"], ["--on-spike", "'panic'"]),
    ("skip-gate-unknown", ["--skip-gate", "gradient_flo"], ["--skip-gate", "did you mean 'gradient_flow'"]),
    ("log-to-unknown", ["--log-to", "wandb"], ["--log-to", "'wandb'"]),
    ("patience-negative", ["--early-stop-patience", "-1"], ["--early-stop-patience", "'-1'"]),
    ("flag-unknown", ["--bogus-flag", "1"], ["--bogus-flag"]),
    ("no-steps", ["--max-steps", "0"], ["--max-steps or --max-tokens"]),
    ("seq-beyond-context", ["--set", "max_seq_len=16"], ["--seq-len 32", "max_seq_len 16"]),
]

# (id, TOML text, what the one error line must contain besides the file's name)
TOML_CASES = [
    ("toml-batch-not-int", '[train]\nbatch_size = "abc"\n', ["[train] batch_size", "'abc'"]),
    ("toml-lr-word", '[train]\nlr = "fast"\n', ["[train] lr", "'fast'"]),
    ("toml-lr-negative", "[train]\nlr = -1e-3\n", ["[train] lr", "-0.001"]),
    ("toml-table-is-a-key", "train = 5\n", ["train = 5", "expected a table"]),
    ("toml-unknown-table", "[trian]\nlr = 1e-3\n", ["unknown table [trian]", "did you mean 'train'"]),
    ("toml-key-outside-table", "lr = 1e-3\n", ["lr = 0.001", "outside any table"]),
    ("toml-unknown-key", "[train]\nbatch_sise = 3\n", ["[train]", "'batch_sise'", "did you mean 'batch_size'"]),
    ("toml-model-key-in-train", "[train]\nn_layers = 2\n", ["[train]", "'n_layers'", "belongs in [model]"]),
    ("toml-model-unknown-key", "[model]\nn_layrs = 2\n", ["[model]", "'n_layrs'", "did you mean 'n_layers'"]),
    ("toml-model-zero-heads", "[model]\nn_heads = 0\n", ["[model] n_heads", "greater than 0"]),
    ("toml-model-bool-for-int", "[model]\nn_layers = true\n", ["[model] n_layers", "valid integer"]),
    ("toml-model-string-for-int", '[model]\nn_layers = "4"\n', ["[model] n_layers", "'4'"]),
    ("toml-dtype-unknown", '[train]\ndtype = "fp8"\n', ["[train] dtype", "'fp8'"]),
    ("toml-preset-unknown", '[train]\npreset = "huge"\n', ["[train] preset", "unknown preset 'huge'"]),
    ("toml-skip-gate-unknown", '[train]\nskip_gates = ["nope"]\n', ["[train] skip_gates", "unknown gate 'nope'"]),
    ("toml-not-toml", "[train\nlr = \n", ["invalid TOML"]),
]


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_error(capsys, rc: int, needles: list[str]) -> str:
    """The run's stderr is exactly one `error:` line holding every needle; exit 2, no traceback."""
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "রান ফোল্ডার" / "run one"  # spaces and Bangla: named in errors as they are


@pytest.mark.parametrize("argv,needles", [c[1:] for c in FLAG_CASES], ids=[c[0] for c in FLAG_CASES])
def test_bad_flag_or_set_is_one_line_and_writes_nothing(bn_data, out, capsys, argv, needles):
    rc = T.main([*BASE, "--data", str(bn_data), "--out", str(out), *argv])
    one_error(capsys, rc, needles)
    assert not out.exists() and not out.parent.exists()


@pytest.mark.parametrize("text,needles", [c[1:] for c in TOML_CASES], ids=[c[0] for c in TOML_CASES])
def test_bad_toml_is_one_line_naming_the_file(bn_data, out, tmp_path, capsys, text, needles):
    cfg = tmp_path / "কনফিগ with space.toml"
    cfg.write_text(text, encoding="utf-8")
    rc = T.main([*BASE, "--data", str(bn_data), "--out", str(out), "--config", str(cfg)])
    line = one_error(capsys, rc, needles)
    assert str(cfg) in line
    assert not out.exists()


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary\x00", b""], ids=["binary", "empty-is-fine"])
def test_config_file_that_is_binary_or_missing(bn_data, out, tmp_path, capsys, content):
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(content)
    argv = [*BASE, "--data", str(bn_data), "--out", str(out), "--config", str(cfg)]
    if content:
        one_error(capsys, T.main(argv), [str(cfg), "not UTF-8"])
    else:  # an empty TOML file is a valid config that sets nothing
        assert C.config_from_args(T.build_parser().parse_args(argv)).preset == "tiny"
    one_error(capsys, T.main([*argv[:-1], str(tmp_path / "nope.toml")]), ["nope.toml", "not found"])
    assert not out.exists()


def test_existing_run_folder_is_untouched_by_a_bad_config(bn_data, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("a run folder's own file\n")
    before = digest(out)
    for argv in (["--set", "n_layers=abc"], ["--dtype", "bogus"], ["--set", "n_heads=3"]):
        one_error(capsys, T.main([*BASE, "--data", str(bn_data), "--out", str(out), *argv]), [])
    assert digest(out) == before


def test_sft_flags_pass_through_the_same_schema(tmp_path, capsys):
    base = ["--init", str(tmp_path / "no run"), "--data", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o")]
    one_error(capsys, sft.main([*base, "--epochs", "0"]), ["--epochs", "'0'"])
    one_error(capsys, sft.main([*base, "--epochs", "nan"]), ["--epochs", "'nan'"])
    one_error(capsys, sft.main([*base, "--set", "n_heads=0"]), ["--set n_heads", "'0'"])
    one_error(capsys, sft.main([*base, "--lr", "-1"]), ["--lr"])
    assert not (tmp_path / "o").exists()


def test_a_bad_flag_from_the_real_command_line_is_one_line():
    """As a user runs it: no usage block, only the one line (argparse's own errors included)."""
    p = preloaded.run([sys.executable, "training/train.py", "--data", "d", "--out", "o", "--max-steps", "2",
                        "--lr", "nan"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: argument --lr: Input should be a finite number (got 'nan')"], p.stderr


def test_run_main_returns_the_exit_status(capsys):
    """main(argv) returns 0 / 2 / the body's own int; a summary the body returns is not a status."""
    p = ArgumentParser(prog="x")
    p.add_argument("--n", type=flag(PositiveInt), default=1)
    assert run_main(p, ["--n", "1"], lambda a: {"final_loss": 1.0}) == 0
    assert run_main(p, [], lambda a: 3) == 3
    one_error(capsys, run_main(p, ["--n", "0"], lambda a: None), ["argument --n", "'0'"])
    one_error(capsys, run_main(p, [], lambda a: int("x")), ["invalid literal"])


def test_help_still_exits_zero(capsys):
    assert T.main(["--help"]) == 0
    assert "--early-stop-patience" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- valid input
def parse(argv: list[str]) -> C.TrainConfig:
    return C.config_from_args(T.build_parser().parse_args(argv))


def test_toml_with_bangla_paths_and_spaces_parses(tmp_path):
    d = tmp_path / "বাংলা কনফিগ"
    d.mkdir()
    data, run = d / "ডেটা ফোল্ডার", d / "রান ১"
    cfg = d / "প্রশিক্ষণ রেসিপি.toml"
    cfg.write_text(f'[train]\npreset = "tiny"\ndata = "{data.as_posix()}"\nout = "{run.as_posix()}"\n'
                   'max_steps = 3\nlr = 1e-3\nschedule = "wsd"\nskip_gates = ["throughput", "data.no_repeats"]\n'
                   'early_stop_patience = 2\nreset_optimizer = true\nlog_to = "tensorboard"\n'
                   '[model]\nn_layers = 1\nrope_theta = 500000\n', encoding="utf-8")
    c = parse(["--config", str(cfg), "--skip-gate", "overfit_one_batch"])
    assert (c.data, c.out, c.preset, c.max_steps, c.lr, c.schedule) == (str(data), str(run), "tiny", 3, 1e-3, "wsd")
    assert c.skip_gates == ["throughput", "data.no_repeats", "overfit_one_batch"]
    assert (c.early_stop_patience, c.reset_optimizer, c.log_to) == (2, True, "tensorboard")
    assert c.model == {"n_layers": 1, "rope_theta": 500000.0} and isinstance(c.model["rope_theta"], float)
    mc = c.model_config(2048)
    assert (mc.n_layers, mc.rope_theta, mc.d_model) == (1, 500000.0, 256)
    assert not data.exists() and not run.exists()  # parsing reads, never writes


def test_precedence_preset_toml_flags_set(tmp_path):
    """preset's [train] < --config < flags < --set, key by key."""
    base = ["--data", "d", "--out", "o", "--max-steps", "5", "--preset", "400m"]
    c = parse(base)
    recipe = preset_tables("400m")["train"]
    assert (c.lr, c.seq_len, c.schedule, c.dtype) == (recipe["lr"], 2048, "wsd", "bf16")
    assert c.weight_decay == C.TrainConfig.weight_decay  # what the preset leaves alone keeps the default
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nlr = 2e-4\nseq_len = 1024\nschedule = \"cosine\"\n[model]\nn_layers = 4\n")
    c = parse([*base, "--config", str(toml)])
    assert (c.lr, c.seq_len, c.schedule, c.dtype, c.model) == (2e-4, 1024, "cosine", "bf16", {"n_layers": 4})
    c = parse([*base, "--config", str(toml), "--lr", "1e-4"])
    assert (c.lr, c.seq_len) == (1e-4, 1024)
    c = parse([*base, "--config", str(toml), "--lr", "1e-4", "--set", "lr=5e-5", "--set", "n_layers=2"])
    assert (c.lr, c.model) == (5e-5, {"n_layers": 2})
    # a preset chosen in the TOML file brings its own recipe; a flag's preset wins over the file's
    toml.write_text('[train]\npreset = "1b"\n')
    assert parse(["--data", "d", "--out", "o", "--max-steps", "5", "--config", str(toml)]).lr == \
        preset_tables("1b")["train"]["lr"]
    c = parse(["--data", "d", "--out", "o", "--max-steps", "5", "--config", str(toml), "--preset", "tiny"])
    assert (c.preset, c.lr, c.seq_len) == ("tiny", C.TrainConfig.lr, C.TrainConfig.seq_len)


def test_tiny_and_small_keep_the_default_recipe():
    for name in ("tiny", "small"):
        assert C.preset_train(name) == {}
        c = parse(["--data", "d", "--out", "o", "--max-steps", "5", "--preset", name])
        assert c == C.TrainConfig(data="d", out="o", max_steps=5, preset=name)


# ------------------------------------------------------------------------------------------- presets
OLD_SHAPES = {  # the hard-coded presets before they moved to training/presets/*.toml
    "tiny": dict(vocab_size=2048, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=256),
    "small": dict(vocab_size=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=512),
    "400m": dict(vocab_size=32768, d_model=1024, n_layers=32, n_heads=16, n_kv_heads=4, ffn_dim=2816,
                 max_seq_len=2048),
    "1b": dict(vocab_size=32768, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, max_seq_len=2048),
}


@pytest.mark.parametrize("name", list(OLD_SHAPES))
def test_preset_toml_round_trips_to_the_old_shape(name):
    assert PRESETS[name] == ModelConfig(**OLD_SHAPES[name]) == preset(name)
    assert preset(name) is not PRESETS[name]  # a fresh copy: callers may change it
    assert ModelConfig.from_dict(PRESETS[name].to_dict()) == PRESETS[name]
    C.preset_train(name)  # every preset's recipe passes the [train] schema
    assert (REPO / "training" / "presets" / f"{name}.toml").is_file()


def test_presets_are_listed_smallest_first():
    assert list(PRESETS) == list(preset_names()) == ["tiny", "small", "400m", "1b"]


def test_big_presets_carry_a_gpu_recipe():
    for name in ("400m", "1b"):
        r = C.preset_train(name)
        assert r["dtype"] == "bf16" and r["seq_len"] == 2048 and r["schedule"] in ("cosine", "wsd")
        assert 3e-4 <= r["lr"] <= 6e-4


# ------------------------------------------------------------------------------------------- schema
def test_model_config_is_a_checked_dataclass():
    with pytest.raises(SchemaError, match="n_heads = 0"):
        ModelConfig(n_heads=0)  # never ZeroDivisionError
    with pytest.raises(SchemaError, match="divisible"):
        ModelConfig(n_heads=3)
    with pytest.raises(SchemaError, match="did you mean 'n_layers'"):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "n_layer": 2})
    with pytest.raises(SchemaError, match="model config"):
        ModelConfig.from_dict([1, 2])  # type: ignore[arg-type]
    mc = ModelConfig(n_layers=3)
    assert dataclasses.is_dataclass(mc) and dataclasses.asdict(mc) == mc.to_dict()
    assert [f.name for f in dataclasses.fields(ModelConfig)][:3] == ["vocab_size", "d_model", "n_layers"]


def test_train_config_built_in_code_is_checked_too():
    with pytest.raises(SchemaError, match="lr = nan"):
        C.TrainConfig(lr=float("nan"))
    with pytest.raises(SchemaError, match="dtype"):
        C.TrainConfig(dtype="fp16")
    with pytest.raises(SchemaError, match="unknown gate"):
        C.TrainConfig(skip_gates=["nope"])
    assert C.TrainConfig(device="cuda:1").device == "cuda:1"
    c = C.TrainConfig()
    assert (c.reset_optimizer, c.early_stop_patience, c.log_to) == (False, 0, "")


def test_every_setting_has_help_and_is_documented():
    doc = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    train_keys = [f.name for f in dataclasses.fields(C.TrainConfig)]
    assert set(C.HELP) == set(train_keys)
    missing = [k for k in [*train_keys, *(f.name for f in dataclasses.fields(ModelConfig))] if f"`{k}`" not in doc]
    assert not missing, f"docs/config.md does not mention {missing}"

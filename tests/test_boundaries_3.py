"""Hostile inputs, third sweep (issue #42), items 1, 7, 8 and 10: each test from the promise.

The promise for every refused input: exit != 0, one `error:` line naming the flag (or file, field,
URL), no traceback, and every file that existed before byte-identical afterwards. The roots:

1. outputs never overlap inputs: every command that writes refuses an --out that is, holds or lies in
   one of its inputs (or the run it reads), --force or not, however the folder is spelled (relative,
   `..`, a symbolic link, a URL's two spellings);
7. store URLs: one URL type (no empty, `.` or `..` segment), commands that take local paths only refuse
   a URL by name, commit markers checked by their schema, a store's refusal is one line naming the URL;
8. `--init-from`'s config.json read strictly: no coercion, both RoPE spellings reconciled, scaled RoPE
   refused by name, bounded nesting;
10. a full disk while writing the HF export is one line and leaves no half-written hf/; every program
   under scripts/ and every `python -m PACKAGE` answers --help.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import preloaded
import pytest
from fixtures_reliability import call_main, one_error, tree_digest

from training.runfiles import layout

REPO = Path(__file__).resolve().parents[1]
FORCE = ("", "--force")


def _corpus(root: Path) -> Path:
    """A user's corpus folder (refusals happen before a byte of it is read)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "bn.txt").write_text("আমি বাংলায় গান গাই।\n" * 20, encoding="utf-8")
    return root


def _refused(module: str, argv: list, capsys, *names: str, keep: Path) -> str:
    before = tree_digest(keep)
    line = one_error(*call_main(module, argv, capsys), *names)
    assert tree_digest(keep) == before, "a file of the user's changed"
    return line


# ------------------------------------------------------------------------------- 1: outputs apart from inputs
@pytest.mark.parametrize("force", FORCE)
@pytest.mark.parametrize("spelling", ["same", "parent", "child", "symlink", "relative", "dotdot", "file-inside"])
def test_prepare_never_writes_over_its_input(spelling, force, tmp_path, monkeypatch, capsys):
    corpus = _corpus(tmp_path / "home" / "corpus")
    (tmp_path / "link").symlink_to(corpus, target_is_directory=True)
    monkeypatch.chdir(tmp_path / "home")
    inp, out = {"same": (corpus, corpus), "parent": (corpus, corpus.parent), "child": (corpus, corpus / "data"),
                "symlink": (tmp_path / "link", corpus), "relative": ("corpus", corpus),
                "dotdot": (corpus, tmp_path / "home" / "x" / ".." / "corpus"),
                "file-inside": (corpus / "bn.txt", corpus)}[spelling]
    argv = ["--input", inp, "--out", out, *([force] if force else [])]
    line = _refused("training.prepare.prepare_cli", argv, capsys, "--out", keep=tmp_path)
    assert "--input" in line  # both flags named
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "link"]


@pytest.mark.parametrize(("flag", "where"), [("--tokenizer", "tok.model"), ("--decontaminate", "eval"),
                                             ("--quality", "q.toml"), ("--extend-tokenizer", "base.model")])
def test_prepare_out_holding_another_input_is_refused(flag, where, tmp_path, capsys):
    corpus = _corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    out.mkdir()
    (out / where).write_text("x")
    extra = ["--add-pieces", "8"] if flag == "--extend-tokenizer" else []
    line = _refused("training.prepare.prepare_cli", ["--input", corpus, "--out", out, flag, out / where, *extra, "--force"],
                    capsys, "--out", keep=tmp_path)
    assert flag in line


def test_merge_never_writes_over_a_shard(tmp_path, capsys):
    a, b = _corpus(tmp_path / "a"), _corpus(tmp_path / "b")
    for out in (a, tmp_path, a / "merged"):
        line = _refused("training.prepare.prepare_cli", ["merge", a, b, "--out", out, "--force"], capsys, "--out",
                        keep=tmp_path)
        assert "SHARD_DIR" in line


@pytest.mark.parametrize(("flag", "out"), [
    ("--data", "{data}"), ("--data", "{data}/run"), ("--data", "{tmp}"), ("--init", "{run}"),
    ("--init", "{run}/checkpoints/x"), ("--init-from", "{hf}/../hf"),
])
def test_train_out_apart_from_what_it_reads(flag, out, tmp_path, capsys):
    data, run, hf = _corpus(tmp_path / "data"), _corpus(tmp_path / "run"), _corpus(tmp_path / "hf")
    given = {"--data": data, "--init": run, "--init-from": hf}
    argv = ["--preset", "tiny", "--data", data, "--max-steps", "1", "--force",
            "--out", out.format(data=data, run=run, hf=hf, tmp=tmp_path)]
    if flag != "--data":
        argv += [flag, given[flag]]
    line = _refused("training.train", argv, capsys, "--out", keep=tmp_path)
    assert flag in line


@pytest.mark.parametrize(("data", "out"), [
    ("s3://b/corpus", "s3://b/corpus"), ("s3://b/corpus", "s3://b/corpus/run"), ("gcs://b/d", "gs://b/d/"),
    ("s3://b/x/run", "s3://b/x"),
])
def test_train_url_out_apart_from_url_data(data, out, tmp_path, capsys):
    argv = ["--preset", "tiny", "--data", data, "--out", out, "--max-steps", "1", "--cache", tmp_path / "c"]
    line = _refused("training.train", argv, capsys, "--out", keep=tmp_path)
    assert "--data" in line and "never writes where it reads" in line, line  # not a store error: nothing contacted


def test_train_cache_apart_from_data(tmp_path, capsys):
    data = _corpus(tmp_path / "data")
    argv = ["--preset", "tiny", "--data", data, "--out", "s3://b/run", "--max-steps", "1", "--cache", data / "c"]
    assert "--data" in _refused("training.train", argv, capsys, "--cache", keep=tmp_path)


@pytest.mark.parametrize("out", ["{init}", "{init}/sft", "{chats}", "{tmp}"])
def test_sft_out_apart_from_init_and_data(out, tmp_path, capsys):
    init, chats = _corpus(tmp_path / "run"), _corpus(tmp_path / "chats")
    argv = ["--init", init, "--data", chats / "bn.txt", "--out", out.format(init=init, chats=chats, tmp=tmp_path)]
    line = _refused("training.sft", argv, capsys, "--out", keep=tmp_path)
    assert ("--init" in line or "--data" in line) and "never writes where it reads" in line, line


@pytest.fixture(scope="module")
def own_run(tiny_run, tmp_path_factory) -> Path:
    """A copy of the shared run (its newest checkpoint and run files): code that broke the rule would write
    into it, and the shared fixture must stay as it was built."""
    run = tmp_path_factory.mktemp("b3") / "run"
    shutil.copytree(tiny_run, run, ignore=lambda d, names: sorted(n for n in names if n.startswith(layout.STEP_PREFIX)
                                                                  and Path(d).name == layout.CHECKPOINTS)[:-1])
    return run


@pytest.mark.parametrize("out", ["{run}", "{run}/checkpoints", "{ckpt}", "{ckpt}/x", "{link}/./checkpoints/..",
                                 "{link}/..", "{texts}"])
def test_export_out_apart_from_the_run(out, own_run, tmp_path, capsys):
    link = own_run.parent / "link"  # the run through a symbolic link: one folder however it is named
    if not link.exists():
        link.symlink_to(own_run, target_is_directory=True)
    ckpt = next((own_run / layout.CHECKPOINTS).iterdir())
    texts = tmp_path / "texts.txt"
    texts.write_text("এক\n")
    out = out.format(run=own_run, ckpt=ckpt, texts=tmp_path, link=link)
    before = tree_digest(own_run)
    line = one_error(*call_main("export.__main__", ["safetensors", link, "--out", out, "--texts", texts, "--force",
                                                    "--no-parity"], capsys), "--out")
    assert any(f in line for f in ("RUN_DIR", "CHECKPOINT_DIR", "--texts")), line
    assert tree_digest(own_run) == before



@pytest.mark.parametrize("out", ["{run}", "{run}/checkpoints", "{ckpt}", "{ckpt}/onnx"])
def test_onnx_stream_out_apart_from_the_run(out, own_run, capsys):
    """`python -m export.onnx_stream RUN --out` (docs/onnx.md) keeps the rule too, --force included."""
    ckpt = next((own_run / layout.CHECKPOINTS).iterdir())
    before = tree_digest(own_run)
    line = one_error(*call_main("export.onnx_stream", [own_run, "--out", out.format(run=own_run, ckpt=ckpt),
                                                       "--force"], capsys), "--out")
    assert "RUN_DIR" in line or "CHECKPOINT_DIR" in line, line
    assert tree_digest(own_run) == before


def test_imatrix_outputs_apart_from_their_inputs(tmp_path, capsys):
    """`python -m export.imatrix`: --out over the model or the calibration text, DST over SRC or the
    matrix, each refused before llama.cpp's tools run (so no model is needed), --force included."""
    model, text, mat = tmp_path / "m.gguf", tmp_path / "c.txt", tmp_path / "m.imatrix"
    for f in (model, text, mat):
        f.write_bytes(b"user's file")
    before = tree_digest(tmp_path)
    cases = [(["compute", model, "--out", model, "--force"], "MODEL"),
             (["compute", model, "--text", text, "--out", text, "--force"], "--text"),
             (["quantize", model, model, "--imatrix", mat, "--force"], "SRC"),
             (["quantize", model, mat, "--imatrix", mat, "--force"], "--imatrix")]
    for argv, named in cases:
        line = one_error(*call_main("export.imatrix", argv, capsys), named)
        assert "never writes where it reads" in line, line
    assert tree_digest(tmp_path) == before

def test_evaluate_out_apart_from_its_inputs(own_run, tmp_path, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "t.txt").write_text("আমি ভাত খাই।\n" * 5, encoding="utf-8")
    before = tree_digest(own_run)
    for out, named in ((texts, "--text"), (own_run / layout.CHECKPOINTS, "RUN_OR_CHECKPOINT")):
        line = one_error(*call_main("training.evaluate.evaluate_cli", [own_run, "--text", texts / "t.txt", "--out", out,
                                                              "--no-twin", "--gen-tokens", "0", "--force"], capsys),
                         "--out")
        assert named in line
    model = tmp_path / "m" / "model.gguf"
    model.parent.mkdir()
    model.write_bytes(b"never read: the --out is refused first")
    line = one_error(*call_main("export.evaluate", [model, "--text", texts / "t.txt", "--out", model.parent,
                                                    "--force"], capsys), "--out")
    assert "FILE" in line
    assert tree_digest(own_run) == before and model.read_bytes().startswith(b"never read")


# --------------------------------------------------------------------------------------------- 7: store URLs
@pytest.mark.parametrize(("module", "argv", "flag"), [
    ("training.prepare.prepare_cli", ["--input", "{corpus}", "--out", "s3://b/data"], "--out"),
    ("training.prepare.prepare_cli", ["--input", "s3://b/corpus", "--out", "{tmp}/d"], "--input"),
    ("training.prepare.prepare_cli", ["--input", "{corpus}", "--out", "{tmp}/d", "--tokenizer", "gs://b/t.model"], "--tokenizer"),
    ("training.prepare.prepare_cli", ["merge", "s3://b/s0", "{corpus}", "--out", "{tmp}/d"], "SHARD_DIR"),
    ("demo", ["--model", "s3://b/run/export/gguf/m.gguf"], "--model"),
    ("export.evaluate", ["s3://b/run/export/gguf/m.gguf"], "FILE"),
    ("training.evaluate.evaluate_cli", ["s3://b/run", "--no-twin"], "path"),
    ("export", ["safetensors", "{corpus}", "--out", "s3://b/x"], "--out"),
])
def test_local_only_commands_refuse_a_url_by_name(module, argv, flag, tmp_path, monkeypatch, capsys):
    corpus = _corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)  # where a folder `s3:` would appear
    argv = [a.format(corpus=corpus, tmp=tmp_path) for a in argv]
    module = "demo.__main__" if module == "demo" else "export.__main__" if module == "export" else module
    line = _refused(module, argv, capsys, flag, keep=tmp_path)
    assert "URL" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


BAD_URLS = [("s3:///run", "no bucket"), ("s3://b/runs/..", "'..'"), ("s3://b//run", "empty segment"),
            ("s3://b/./run", "'.'"), ("gs://b/run?x=1", "query"), ("s3://b/a/../../run", "'..'")]


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_a_malformed_store_url_is_refused_wherever_a_url_is_taken(url, why, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: the URL is refused first
    data = _corpus(tmp_path / "data")
    cases = [("training.train", ["--preset", "tiny", "--data", data, "--max-steps", "1", "--out", url], "--out"),
             ("training.train", ["--preset", "tiny", "--data", url, "--max-steps", "1", "--out", "r"], "--data"),
             ("training.train", ["--preset", "tiny", "--data", data, "--max-steps", "1", "--init", url,
                                 "--out", "r"], "--init"),
             ("training.sft", ["--init", url, "--data", data / "bn.txt", "--out", "r"], "--init"),
             ("export.__main__", ["gguf", url], "RUN_DIR"),
             ("serving.__main__", [url + "/export/gguf/m.gguf"], "MODEL")]
    for module, argv, flag in cases:
        line = _refused(module, argv, capsys, flag, keep=tmp_path)
        assert why in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_store_that_refuses_is_one_line_naming_the_url(s3_server, tmp_path, monkeypatch, capsys):
    """An endpoint that is not a URL, a bucket name the store rejects: the URL and the cause, no traceback."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    for url, cause in (("s3://Not_A-Valid..Bucket/run", "bucket"), ("s3://b" + "x" * 70 + "/run", "bucket")):
        line = one_error(*call_main("export.__main__", ["gguf", url], capsys), url)
        assert cause in line.lower(), line
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not a url")
    line = one_error(*call_main("export.__main__", ["gguf", "s3://bucket/run"], capsys), "s3://bucket/run")
    assert "AWS_ENDPOINT_URL" in line and "endpoint" in line, line


SHA = "0" * 64
BAD_MARKERS = [
    {"prodip_commit": 1, "files": {"model.safetensors": 5}},  # the AttributeError of the issue
    {"prodip_commit": 1, "files": ["model.safetensors"]},
    {"prodip_commit": 1, "files": {"model.safetensors": {"size": "5", "sha256": SHA}}},
    {"prodip_commit": 1, "files": {"../../escape": {"size": 5, "sha256": SHA}}},
    {"prodip_commit": "1", "files": {"model.safetensors": {"size": 5, "sha256": SHA}}},
    [1, 2, 3],
]


def test_a_commit_marker_of_the_wrong_shape_is_not_trusted(s3_server, tmp_path, monkeypatch, capsys):
    """Checked by its schema before use: a damaged marker vouches for nothing (as after an upload cut
    short), never an AttributeError; through the commands, one line naming the URL."""
    from training.store import remote_run as remote

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(remote, "CACHE_ROOT", tmp_path / "cache")
    fs = s3_server.fs()
    fs.mkdir("markers")
    good = {"prodip_commit": 1, "step": 3, "files": {"model.safetensors": {"size": 5, "sha256": SHA}}}
    other_step = {**good, "step": 7}  # a well-formed marker, but not step_0000003's: vouches for no checkpoint
    markers = [good, *BAD_MARKERS, other_step]
    fs.pipe({f"markers/run{i}/{rel}": data for i, marker in enumerate(markers) for rel, data in (
        ("checkpoints/step_0000003/model.safetensors", b"12345"), ("export/model.safetensors", b"12345"),
        ("checkpoints/step_0000003.commit.json", json.dumps(marker).encode()),
        ("export.commit.json", json.dumps(marker).encode()))})  # one batch: the runs' files and markers
    for i, marker in enumerate(markers):
        r = remote.Remote(f"s3://markers/run{i}")
        trusted = r.scan()[0] != [], r.read_commit(layout.EXPORT, remote.EXPORT_COMMIT) is not None
        assert trusted == (marker is good, marker in (good, other_step)), (marker, trusted)
    line = one_error(*call_main("export.__main__", ["gguf", "s3://markers/run1", "--out", tmp_path / "e"], capsys),
                     "no committed checkpoint")
    assert "s3://markers/run1" in line
    one_error(*call_main("serving.__main__", ["s3://markers/run1/export/model.safetensors"], capsys),
              "no committed export")
    assert list(tmp_path.iterdir()) == []  # nothing pulled, no export folder


# ------------------------------------------------------------------------------------ 8: --init-from strictly
LLAMA = {  # what transformers 5.25 writes for a LlamaConfig (LlamaConfig(...).to_json_string())
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 2048, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": None,
    "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "transformers_version": "5.25.0", "use_cache": True, "vocab_size": 100,
}
ROPE4 = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}  # transformers 4's spelling


@pytest.mark.parametrize(("over", "named"), [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings"),
    ({"rope_theta": [10000.0]}, "rope_theta"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_theta": 500000.0}, "disagrees"),  # beside rope_parameters' 10000
    ({"rope_theta": "10000"}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_parameters.rope_theta"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 2.0}, "num_key_value_heads"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"max_position_embeddings": -5}, "max_position_embeddings"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"attention_dropout": 2}, "attention_dropout"),
    ({"mlp_bias": "no"}, "mlp_bias"),
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"architectures": "LlamaForCausalLM"}, "architectures"),
    ({"rope_scaling": {"rope_type": "default", "factor": 8.0}}, "factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "default", "type": "linear"}}, "'linear'"),
    ({"rope_scaling": {"rope_theta": 20000.0}}, "disagrees"),
    ({"rope_scaling": [1]}, "rope_scaling"),
])
def test_init_from_config_is_read_strictly(over, named, tmp_path):
    from training.model.hf_import import InitFromError, model_config

    with pytest.raises(InitFromError) as e:
        model_config({**LLAMA, **over}, tmp_path / "config.json")
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_init_from_config_both_spellings_agreeing_or_one_is_read(tmp_path):
    from training.model.hf_import import model_config

    for hf in (LLAMA, {**LLAMA, "rope_theta": 10000.0}, {**ROPE4, "rope_theta": 10000.0, "rope_scaling": None},
               {**ROPE4, "rope_theta": 10000}):
        cfg = model_config(hf, tmp_path / "config.json")
        assert (cfg.rope_theta, cfg.n_kv_heads, cfg.n_layers, cfg.tie_embeddings) == (10000.0, 2, 2, False)
    assert model_config({**LLAMA, "num_key_value_heads": None}, tmp_path).n_kv_heads == 4  # absent: every head
    assert model_config({**LLAMA, "tie_word_embeddings": True}, tmp_path).tie_embeddings is True


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000, '{"a": ' * 5000 + "1" + "}" * 5000])
def test_init_from_a_deeply_nested_config_is_one_error(body, tmp_path, capsys):
    """Through the command (`train.py --plan` reads config.json alone): one line, no RecursionError."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(body)
    argv = ["--preset", "tiny", "--data", tmp_path / "no-data", "--out", tmp_path / "r", "--max-steps", "1",
            "--init-from", tmp_path / "hf", "--plan"]
    assert "nested deeper" in _refused("training.train", argv, capsys, "config.json", keep=tmp_path)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**LLAMA, "tie_word_embeddings": "false"}))
    _refused("training.train", argv, capsys, "tie_word_embeddings", keep=tmp_path)


# ----------------------------------------------------------------------------- 10: a full disk, --help
LIMITED = """import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv.pop(1)),) * 2)
sys.argv[0] = "export"
runpy.run_module("export", run_name="__main__", alter_sys=True)
"""


def test_full_disk_during_the_hf_export_is_one_line_and_leaves_nothing(tiny_run, tmp_path):
    run = tmp_path / "run"
    run.symlink_to(tiny_run, target_is_directory=True)
    weights = next((tiny_run / layout.CHECKPOINTS).iterdir()) / layout.MODEL_WEIGHTS
    limited = tmp_path / "limited.py"  # `python limited.py LIMIT ARGS`: the export under a file-size limit
    limited.write_text(LIMITED)
    out = tmp_path / "export"
    argv = [sys.executable, str(limited), str(weights.stat().st_size // 2), "safetensors", str(run), "--out", str(out),
            "--no-parity"]
    r = preloaded.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    one_error(r.returncode, r.stdout, r.stderr, "could not write the HF export")
    assert "too large" in r.stderr.lower() or "no space" in r.stderr.lower(), r.stderr
    left = sorted(str(p.relative_to(tmp_path)) for p in out.rglob("*")) if out.exists() else []
    assert not [p for p in left if "hf" in p or "tmp" in p], left  # no half-written hf/, no temporary folder


SCRIPTS = sorted(p for p in (REPO / "scripts").iterdir() if p.suffix in (".sh", ".py"))
PACKAGES = sorted(str(p.parent.relative_to(REPO)).replace("/", ".") for top in ("training", "export", "serving", "demo")
                  for p in (REPO / top).rglob("__main__.py"))


def test_every_script_and_package_answers_help():
    assert {p.name for p in SCRIPTS} >= {"gpu_check.sh", "setup.sh", "test.sh"} and "export" in PACKAGES
    env = {**os.environ, "PRODIP_VENV": "/nonexistent"}  # quickstart.sh: its own usage, no second interpreter
    for script in SCRIPTS:
        if script.suffix == ".sh":
            r = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, cwd="/", env=env,
                               timeout=120)
        else:  # python SCRIPT.py: forked from the preloaded interpreter (gpu_validate.py imports torch)
            r = preloaded.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=REPO,
                              timeout=120)
        assert r.returncode == 0 and r.stdout.lower().startswith("usage"), f"{script.name}:\n{r.stdout}\n{r.stderr}"
        assert "error" not in r.stderr.lower(), f"{script.name}: {r.stderr}"
    for package in PACKAGES:
        r = preloaded.run([sys.executable, "-m", package, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), f"{package}:\n{r.stdout}\n{r.stderr}"


@pytest.mark.parametrize("out", ["{d}", "{d}/results", "{tmp}"])
def test_gpu_check_out_apart_from_data(out, tmp_path):
    """scripts/gpu_check.sh refuses before it installs anything (scripts/gpu_validate.py has the same rule)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text("{}")
    before = tree_digest(tmp_path)
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--out", out.format(d=data, tmp=tmp_path),
                        "--data", str(data)], capture_output=True, text=True, timeout=60)
    one_error(r.returncode, r.stdout, r.stderr, "--data")
    assert tree_digest(tmp_path) == before

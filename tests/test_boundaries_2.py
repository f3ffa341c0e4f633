"""Hostile inputs, second sweep (issue #28): one case per class, each from the promise.

The promise for every refused input: exit != 0, exactly one `error:` line that names the flag, file
or field, no traceback, and every file that existed before byte-identical afterwards (nothing
written, nothing left behind). The classes:

1. a user's folder is never taken for prodip's own (export --out, export.onnx_stream --out), and a
   failed --imatrix leaves no --out behind;
2. every JSON reader is bounded (nesting depth): sft, evaluate --mc/--text, prepare JSONL, HTTP;
3. text that is not valid Unicode (JSON's lone "\\ud800", non-UTF-8 bytes in an argument or a file
   name) is refused at the boundary, before anything runs;
4. a multiple-choice record of the wrong shape is refused, in training.evaluate and export.evaluate;
5. nothing is silently normalised: vocab_size, --mix, --gen-tokens, --n-ctx, top_k, --threshold;
6. a URL where a local folder belongs (`--out s3://bucket/run`) is refused;
7. exported files keep the user's umask.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import CORPUS
from fixtures_reliability import call_main, child_env, one_error, train_argv, tree_digest

from training.runfiles import layout

MISSING = "/nonexistent/prodip-boundaries-2/missing"
DEEP = 100_000  # far past any parser's recursion limit (CPython's json gives up near 1000)
SURROGATE = '"\\ud800"'  # a lone surrogate as JSON writes it: valid JSON, not valid Unicode
NOT_UTF8 = b"caf\xe9".decode("utf-8", "surrogateescape")  # Latin-1 bytes as Python holds them in argv


def deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


# ------------------------------------------------------------------ 2 + 3: bounded, valid-Unicode readers
def _files(tmp_path: Path) -> dict[str, Path]:
    """One hostile file per kind: a record nested DEEP levels, and one holding a lone surrogate."""
    out = {}
    for name, body in {
        "deep.jsonl": deep_json() + "\n",
        "deep.json": "[" + deep_json() + "]",
        "deep-chat.jsonl": '{"messages": ' + deep_json() + "}\n",
        "lone-chat.jsonl": '{"messages": [{"role": "user", "content": ' + SURROGATE + '}, '
                           '{"role": "assistant", "content": "ok"}]}\n',
        "lone-mc.jsonl": '{"query": ' + SURROGATE + ', "choices": ["a", "b"], "gold": 0}\n',
        "lone-text.jsonl": '{"text": "ab ' + SURROGATE[1:-1] + ' cd"}\n',
        "deep-text.jsonl": '{"text": "x", "meta": ' + deep_json() + "}\n",
    }.items():
        out[name] = tmp_path / name
        out[name].write_text(body, encoding="utf-8")
    return out


@pytest.mark.parametrize(("module", "argv", "file"), [
    ("training.evaluate.evaluate_cli", [MISSING, "--mc", "{f}", "--no-twin"], "deep.jsonl"),
    ("training.evaluate.evaluate_cli", [MISSING, "--mc", "{f}", "--no-twin"], "deep.json"),
    ("training.evaluate.evaluate_cli", [MISSING, "--text", "{f}", "--no-twin"], "deep-text.jsonl"),
    ("training.evaluate.evaluate_cli", [MISSING, "--mc", "{f}", "--no-twin"], "lone-mc.jsonl"),
    ("training.evaluate.evaluate_cli", [MISSING, "--text", "{f}", "--no-twin"], "lone-text.jsonl"),
    ("export.evaluate", ["{model}", "--mc", "{f}"], "deep.jsonl"),
    ("export.evaluate", ["{model}", "--mc", "{f}"], "lone-mc.jsonl"),
    ("training.prepare.prepare_cli", ["--input", "{f}", "--out", "{tmp}/data", "--strict"], "deep-text.jsonl"),
    ("training.prepare.prepare_cli", ["--input", "{f}", "--out", "{tmp}/data", "--strict"], "lone-text.jsonl"),
    ("training.prepare.prepare_cli", ["--input", str(CORPUS), "--out", "{tmp}/data", "--decontaminate", "{f}"], "deep.json"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_hostile_json_file_is_one_error_naming_it(module, argv, file, tmp_path, capsys):
    files = _files(tmp_path)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not read: the --mc file is refused first")
    argv = [a.format(f=files[file], model=model, tmp=tmp_path) for a in argv]
    before = tree_digest(tmp_path)
    one_error(*call_main(module, argv, capsys), file)
    assert tree_digest(tmp_path) == before and not (tmp_path / "data").exists()


@pytest.mark.parametrize("file", ["deep-chat.jsonl", "lone-chat.jsonl"])
def test_sft_refuses_a_hostile_chat_file(file, rel_run, tmp_path, capsys):
    files = _files(tmp_path)
    out = tmp_path / "sft"
    one_error(*call_main("training.sft", ["--init", rel_run, "--data", files[file], "--out", out, "--max-steps", "1"],
                    capsys), file)
    assert not out.exists()


def test_the_records_reader_names_depth_and_surrogates_with_the_line(tmp_path):
    from training.runfiles.json_records import RecordError, read_records

    files = _files(tmp_path)
    for name, words in (("deep.jsonl", "nested deeper"), ("deep.json", "nested deeper"),
                        ("lone-chat.jsonl", "lone surrogate U+D800")):
        with pytest.raises(RecordError) as e:
            list(read_records(files[name]))
        assert str(e.value).startswith(f"{files[name]}:1: ") and words in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    # where in the record: the path to the bad string, so a user can find it
    with pytest.raises(RecordError, match=r"messages\[0\]\.content: not valid Unicode"):
        list(read_records(files["lone-chat.jsonl"]))


def test_a_non_utf8_argument_is_refused_before_anything_runs(tmp_path, capsys):
    """Every CLI (through training.runfiles.cli_harness.run_main): the argument named, the bytes shown, exit 2."""
    line = one_error(*call_main("training.prepare.prepare_cli", ["--input", str(tmp_path / NOT_UTF8), "--out", tmp_path / "d"],
                           capsys), "not UTF-8")
    assert "\\xe9" in line
    assert list(tmp_path.iterdir()) == []


def test_train_refuses_a_non_utf8_out_at_once_and_writes_nothing(bn_data, tmp_path):
    """As a user runs it (bytes in argv): refused before the gates, no folder, no tokenizer, no run.json.tmp."""
    out = os.fsencode(tmp_path) + b"/run-\xe9"
    argv = [os.fsencode(a) for a in train_argv(bn_data, tmp_path / "x")]
    argv[argv.index(b"--out") + 1] = out
    before = tree_digest(bn_data)
    r = subprocess.run(argv, capture_output=True, env=child_env(), timeout=120, cwd=tmp_path)
    err = r.stderr.decode("utf-8", "replace")
    one_error(r.returncode, r.stdout.decode("utf-8", "replace"), err, "not UTF-8")
    assert os.listdir(os.fsencode(tmp_path)) == [] and tree_digest(bn_data) == before


def test_a_folder_with_a_non_utf8_file_name_is_refused_by_name(tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(next(CORPUS.glob("*.txt")), inputs / "good.txt")
    (Path(os.fsdecode(os.fsencode(inputs) + b"/bad-\xe9.txt"))).write_text("কিছু লেখা\n", encoding="utf-8")
    before = tree_digest(tmp_path)
    one_error(*call_main("training.prepare.prepare_cli", ["--input", inputs, "--out", tmp_path / "data"], capsys), "bad-\\xe9.txt")
    assert tree_digest(tmp_path) == before and not (tmp_path / "data").exists()


# ------------------------------------------------------------------------------ 4: MC records, one schema
MC_BAD = {
    "choices-a-string": ({"query": "q", "choices": "ab", "gold": 0}, "'choices'"),
    "choices-an-object": ({"query": "q", "choices": {"a": 1, "b": 2}, "gold": 0}, "'choices'"),
    "choices-not-strings": ({"query": "q", "choices": ["a", 2], "gold": 0}, "'choices'"),
    "gold-bool": ({"query": "q", "choices": ["a", "b"], "gold": True}, "'gold'"),
    "gold-float": ({"query": "q", "choices": ["a", "b"], "gold": 1.0}, "'gold'"),
    "gold-out-of-range": ({"query": "q", "choices": ["a", "b"], "gold": 2}, "gold index 2"),
    "label-float": ({"ctx": "c", "endings": ["a", "b"], "label": 0.0}, "'label'"),
    "winogrande-options-string": ({"context_options": "ab", "continuation": "x", "gold": 0}, "'context_options'"),
}


@pytest.mark.parametrize("case", sorted(MC_BAD))
@pytest.mark.parametrize("module", ["training.evaluate.evaluate_cli", "export.evaluate"])
def test_a_wrongly_shaped_mc_record_is_refused(module, case, tmp_path, capsys):
    rec, field = MC_BAD[case]
    mc = tmp_path / "mc.jsonl"
    mc.write_text(json.dumps({"query": "ok", "choices": ["a", "b"], "gold": 1}) + "\n" + json.dumps(rec) + "\n",
                  encoding="utf-8")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not read")
    argv = [MISSING, "--mc", mc, "--no-twin"] if module == "training.evaluate.evaluate_cli" else [model, "--mc", mc]
    line = one_error(*call_main(module, argv, capsys), f"{mc}:2")
    assert field in line, line


def test_valid_mc_shapes_still_parse():
    from training.evaluate.mc import parse_mc_record

    assert parse_mc_record({"query": "q", "choices": ["a", "b"], "gold": 1})[1].gold == 1
    assert parse_mc_record({"ctx": "c", "endings": ["a", "b", "c"], "label": "2"})[1].gold == 2  # HF's string label
    assert parse_mc_record({"instruction": "q", "option_a": "x", "option_b": "y", "answer": "B"})[1].gold == 1


# ---------------------------------------------------------------------------- 5 + 6: no silent normalisation
def test_vocab_size_is_never_replaced_silently(bn_data, tmp_path, capsys):
    from training.train import main as train_main  # noqa: F401  (imported: the CLI under test)

    argv = train_argv(bn_data, tmp_path / "run")[2:]
    one_error(*call_main("training.train", [*argv, "--set", "vocab_size=5"], capsys), "vocab_size = 5")
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nvocab_size = 4096\n", encoding="utf-8")
    one_error(*call_main("training.train", [*argv, "--config", toml], capsys), "vocab_size = 4096")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("mix", "words"), [
    ("bn=0.8,en=0.8", "sum to 1.6"), ("bn=3,en=1", "share of bn is 3"), ("bn=0.5,bn=0.5", "bn is given twice"),
])
def test_mix_is_refused_not_normalised(mix, words, tmp_path, capsys):
    one_error(*call_main("training.prepare.prepare_cli", ["--input", CORPUS, "--out", tmp_path / "d", "--mix", mix], capsys),
              words)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://b/r", "file:///tmp/run"])
def test_out_url_is_refused(url, bn_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = train_argv(bn_data, Path("x"))[2:]
    argv[argv.index("--out") + 1] = url
    one_error(*call_main("training.train", argv, capsys), "--out")
    assert list(tmp_path.iterdir()) == []  # no local folder named `s3:`


def test_gen_tokens_beyond_any_context_is_refused(capsys):
    one_error(*call_main("training.evaluate.evaluate_cli", [MISSING, "--gen-tokens", str(10**9)], capsys), "--gen-tokens")


def test_gen_tokens_beyond_the_model_context_is_refused(rel_run, tmp_path, capsys):
    from fixtures_reliability import N_CTX

    prompts = tmp_path / "p.txt"
    prompts.write_text("নমস্কার\n", encoding="utf-8")
    one_error(*call_main("training.evaluate.evaluate_cli", [rel_run, "--prompts", prompts, "--gen-tokens", str(N_CTX),
                                              "--out", tmp_path / "eval", "--no-twin"], capsys), "--gen-tokens 64")
    assert not (tmp_path / "eval").exists()


def test_export_evaluate_n_ctx_beyond_the_trained_context_is_refused(rel_gguf, tmp_path, capsys):
    from fixtures_reliability import N_CTX

    text = tmp_path / "t.txt"
    text.write_text("নমস্কার, কেমন আছেন?\n", encoding="utf-8")
    before = tree_digest(rel_gguf.parent)
    one_error(*call_main("export.evaluate", [rel_gguf, "--text", text, "--n-ctx", str(N_CTX * 4),
                                        "--out", tmp_path / "eval"], capsys), f"--n-ctx {N_CTX * 4}")
    assert tree_digest(rel_gguf.parent) == before and not (tmp_path / "eval").exists()


@pytest.mark.parametrize("argv_tail", [["--threshold", "onnx-int8.kl=0.1"],
                                        ["--threshold", "safetensors.max_abs=0.1", "--no-parity"]])
def test_a_threshold_nothing_compares_is_refused(argv_tail, rel_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    before = tree_digest(run)
    one_error(*call_main("export.__main__", ["safetensors", run, *argv_tail], capsys), "--threshold")
    assert tree_digest(run) == before and not (run / layout.EXPORT).exists()


# -------------------------------------------------------------------------- 1 + 7: folders and modes
def test_export_never_replaces_a_user_readme(rel_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    mine = tmp_path / "my-folder"
    mine.mkdir()
    (mine / "README.md").write_text("# my notes\n", encoding="utf-8")
    (mine / "log.jsonl").write_text('{"mine": true}\n', encoding="utf-8")
    before = tree_digest(mine)
    line = one_error(*call_main("export.__main__", ["safetensors", run, "--out", mine, "--no-parity"], capsys), "--out")
    assert "--force" in line
    assert tree_digest(mine) == before


def test_onnx_stream_refuses_a_folder_of_unrelated_files(rel_run, tmp_path, capsys):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "cat.jpg").write_bytes(b"\xff\xd8 not ours")
    before = tree_digest(mine)
    one_error(*call_main("export.onnx_stream", [rel_run, "--out", mine, "--no-check"], capsys), "--out")
    assert tree_digest(mine) == before


def test_a_failed_imatrix_leaves_no_out(rel_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(rel_run, run)
    short = tmp_path / "short.txt"
    short.write_text("নমস্কার\n", encoding="utf-8")  # far shorter than one calibration chunk
    out = tmp_path / "new" / "export"
    before = tree_digest(run)
    one_error(*call_main("export.__main__", ["gguf", run, "--q4", "--imatrix", short, "--out", out, "--no-parity"],
                    capsys), "short.txt")
    assert not (tmp_path / "new").exists() and tree_digest(run) == before


def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in root.rglob("*")}


def test_exports_and_checkpoints_keep_the_users_umask(bn_data, tmp_path, capsys):
    """umask 027 (group may read, others nothing): every file 0640, every folder 0750; safetensors'
    own writer made weights 0600, unreadable to the group that serves them."""
    run = tmp_path / "run"
    old = os.umask(0o027)
    try:
        assert call_main("training.train", train_argv(bn_data, run)[2:], capsys)[0] == 0
        rc, out, err = call_main("export.__main__", ["all", run, "--f32", "--no-parity"], capsys)
    finally:
        os.umask(old)
    assert rc == 0, err
    modes = _modes(run)
    files = {k: v for k, v in modes.items() if (run / k).is_file()}
    assert any(k.endswith("hf/model.safetensors") for k in files) and any(k.endswith(".gguf") for k in files)
    assert any(k.endswith("model.safetensors") and k.startswith(layout.CHECKPOINTS) for k in files)
    assert set(files.values()) == {"0o640"}, {k: v for k, v in files.items() if v != "0o640"}
    assert {v for k, v in modes.items() if k not in files} == {"0o750"}, modes


# ------------------------------------------------------------------------------------ HTTP: bounded bodies


@pytest.mark.parametrize(("body", "needle"), [
    ('{"messages": ' + "[" * DEEP + "]" * DEEP + "}", "nested deeper"),
    ('{"messages": [{"role": "user", "content": "x"}], "user": ' + SURROGATE + "}", "lone surrogate"),
    ('{"messages": [{"role": "user", "content": "x"}], "top_k": 1000000000000}', "top_k"),
])
def test_a_hostile_body_is_a_one_line_400(client, body, needle, caplog):
    r = client.post("/v1/chat/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:500]
    msg = r.json()["error"]["message"]
    assert needle in msg and "\n" not in msg, msg
    assert "Traceback" not in caplog.text
    assert client.get("/health").json()["status"] == "ok"

"""The boundaries of the prepare, export and serving command lines (issue [boundaries], part 3).

Hostile input to `python -m training.prepare`, `python -m export` (and its imatrix / onnx_stream
tools), `python -m export.evaluate` and `python -m serving`, run in-process through each CLI's
`main(argv)`: exit != 0, exactly one `error:` line naming the flag or file, no traceback, and an
existing folder byte-identical afterwards. Servers fail before they announce (a busy port, a host
that does not resolve). HTTP bodies are checked by the same schema types as the flags: one-line 400s,
the server alive. Valid runs with spaces and Bangla in their paths still work.
"""

from __future__ import annotations

import importlib
import shutil
import socket
import sys
from pathlib import Path

import pytest
from conftest import CORPUS
from fixtures_reliability import call_main, one_error, run_cli, tree_digest

from serving import load as serving_load

MISSING = "/nonexistent/prodip-boundaries/missing"

# (CLI module, argv, words one of which the error line must hold)
FLAG_CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    # serving: every sampling flag, the caps, the names
    ("serving.__main__", [MISSING, "--max-tokens", "0"], ("--max-tokens",)),
    ("serving.__main__", [MISSING, "--temperature", "-1"], ("--temperature",)),
    ("serving.__main__", [MISSING, "--temperature", "nan"], ("--temperature",)),
    ("serving.__main__", [MISSING, "--temperature", "inf"], ("--temperature",)),
    ("serving.__main__", [MISSING, "--top-p", "0"], ("--top-p",)),
    ("serving.__main__", [MISSING, "--top-p", "1.5"], ("--top-p",)),
    ("serving.__main__", [MISSING, "--top-k", "-1"], ("--top-k",)),
    ("serving.__main__", [MISSING, "--repeat-penalty", "0"], ("--repeat-penalty",)),
    ("serving.__main__", [MISSING, "--seed", "-1"], ("--seed",)),
    ("serving.__main__", [MISSING, "--seed", str(2**64)], ("--seed",)),
    ("serving.__main__", [MISSING, "--threads", "0"], ("--threads",)),
    ("serving.__main__", [MISSING, "--max-body-bytes", "-5"], ("--max-body-bytes",)),
    ("serving.__main__", [MISSING, "--max-tokens-cap", "-1"], ("--max-tokens-cap",)),
    ("serving.__main__", [MISSING, "--backend", "tourch"], ("--backend", "'torch'")),
    ("serving.__main__", [MISSING, "--http", "70000"], ("--http",)),
    ("serving.__main__", [MISSING, "--http", "localhost:http"], ("--http",)),
    # export: numbers, GGUF types, parity thresholds (kind, metric, value), the command
    ("export.__main__", ["gguf", MISSING, "--step", "-1"], ("--step",)),
    ("export.__main__", ["gguf", MISSING, "--threads", "0"], ("--threads",)),
    ("export.__main__", ["gguf", MISSING, "--new-tokens", "0"], ("--new-tokens",)),
    ("export.__main__", ["gguf", MISSING, "--new-tokens", "1e3"], ("--new-tokens",)),
    ("export.__main__", ["gguf", MISSING, "--new-tokens", str(10**9)], ("--new-tokens",)),
    ("export.__main__", ["gguf", MISSING, "--type", "Q4_K_X"], ("--type",)),
    ("export.__main__", ["gguf", MISSING, "--imatrix", MISSING + ".txt"], ("--imatrix",)),
    ("export.__main__", ["parity", MISSING, "--threshold", "kl"], ("--threshold",)),
    ("export.__main__", ["parity", MISSING, "--threshold", "onnx-int8.kl=-1"], ("--threshold",)),
    ("export.__main__", ["parity", MISSING, "--threshold", "onnx-int8.kl=nan"], ("--threshold",)),
    ("export.__main__", ["parity", MISSING, "--threshold", "llama.cpp-Q4_K_M.top1=1.5"], ("--threshold",)),
    ("export.__main__", ["parity", MISSING, "--threshold", "onnx-fp32.maxabs=1"], ("'max_abs'",)),
    ("export.__main__", ["parity", MISSING, "--threshold", "onnx-fp23.kl=1"], ("'onnx-fp32'",)),
    ("export.__main__", ["gguff", MISSING], ("'gguff'",)),
    ("export.imatrix", ["compute", "m.gguf", "--out", "x", "--chunk", "0"], ("--chunk",)),
    ("export.imatrix", ["quantize", "a", "b", "--imatrix", "c", "--type", "Q4_K_X"], ("--type",)),
    ("export.imatrix", ["quantize", "a", "b", "--imatrix", "c", "--threads", "-2"], ("--threads",)),
    ("export.onnx_stream", [MISSING, "--step", "abc"], ("--step",)),
    # export.evaluate: the context and threads reach llama.cpp only when valid
    ("export.evaluate", [MISSING, "--n-ctx", "-5"], ("--n-ctx",)),
    ("export.evaluate", [MISSING, "--n-ctx", "0"], ("--n-ctx",)),
    ("export.evaluate", [MISSING, "--threads", "0"], ("--threads",)),
    ("export.evaluate", [MISSING, "--backend", "lamacpp"], ("--backend",)),
    # prepare: every number, gate and language names, source kinds
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--vocab-size", "0"], ("--vocab-size",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--workers", "0"], ("--workers",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--seed", "-1"], ("--seed",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--val-fraction", "1"], ("--val-fraction",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--val-fraction", "nan"], ("--val-fraction",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--shard-tokens", "0"], ("--shard-tokens",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--fertility-floor", "-inf"],
     ("--fertility-floor",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--num-shards", "0"], ("--num-shards",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--balance-range", "0.8"], ("--balance-range",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--skip-gate", "tokenizer.fertilty"],
     ("'tokenizer.fertility'",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--mix", "bn=0.8,eng=0.2"], ("'en'",)),
    ("training.prepare.prepare_cli", ["--input", MISSING, "--out", MISSING, "--mix", "bn=inf"], ("--mix",)),
    ("training.prepare.prepare_cli", ["--input", "hff:HuggingFaceFW/fineweb-2", "--out", MISSING], ("'hf:'",)),
]


@pytest.mark.parametrize(("module", "argv", "names"), FLAG_CASES,
                         ids=[f"{m.split('.')[0]} {' '.join(a[-2:])}" for m, a, _ in FLAG_CASES])
def test_bad_flag_is_one_error_line(module, argv, names, capsys):
    one_error(*call_main(module, argv, capsys), names)


def test_every_numeric_flag_is_schema_typed():
    """No numeric flag of these CLIs is parsed by plain int/float: each carries a training.runfiles.schema type."""
    import argparse

    from export.imatrix import build_parser as imatrix_parser
    from export.onnx_stream import build_parser as onnx_stream_parser

    parsers = {m: importlib.import_module(m).build_parser()
               for m in ("serving.__main__", "export.__main__", "export.evaluate", "training.prepare.prepare_cli")}
    parsers |= {"export.imatrix": imatrix_parser(), "export.onnx_stream": onnx_stream_parser()}
    stack = list(parsers.items())
    plain = []
    while stack:
        name, p = stack.pop()
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                stack += [(f"{name} {k}", sub) for k, sub in a.choices.items()]
            elif a.type in (int, float):
                plain.append(f"{name} {a.option_strings}")
    assert not plain, plain


# ------------------------------------------------------------------------------- nothing is written
def test_prepare_failure_leaves_the_folder_unchanged(tmp_path, capsys):
    """Even with --force, an input that fails its checks leaves the existing DATA_DIR as it was."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "meta.json").write_text('{"keep": "me"}\n', encoding="utf-8")
    before = tree_digest(out)
    bad_quality = tmp_path / "quality.toml"
    bad_quality.write_text("[qualty]\nmin_words = 3\n", encoding="utf-8")
    for argv, names in [(["--input", MISSING], (MISSING,)),
                        (["--input", str(CORPUS), "--quality", str(bad_quality)], ("'quality'",)),
                        (["--input", str(CORPUS), "--tokenizer", str(bad_quality)], (str(bad_quality),))]:
        one_error(*call_main("training.prepare.prepare_cli", [*argv, "--out", str(out), "--force"], capsys), names)
        assert tree_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "quality.toml"]  # no temp folder left


def _copy_run(rel_run: Path, dest: Path) -> Path:  # noqa: F811
    shutil.copytree(rel_run, dest)
    return dest


@pytest.mark.parametrize("name", ["gates.json", "run.json"])
def test_export_refuses_a_garbage_run_file(name, rel_run, tmp_path, capsys):  # noqa: F811
    run = _copy_run(rel_run, tmp_path / "run")
    (run / name).write_text('{"prodip_gates": 1, "results": [', encoding="utf-8")
    before = tree_digest(run)
    one_error(*call_main("export.__main__", ["gguf", run, "--f32", "--no-parity"], capsys), (name,))
    assert tree_digest(run) == before and not (run / "export").exists()


def test_export_refuses_a_garbage_manifest_before_writing(rel_run, tmp_path, capsys):  # noqa: F811
    run = _copy_run(rel_run, tmp_path / "run")
    out = run / "export"
    out.mkdir()
    (out / "manifest.json").write_bytes(b"\x00\xffnot json")
    before = tree_digest(run)
    one_error(*call_main("export.__main__", ["gguf", run, "--f32", "--no-parity"], capsys), ("manifest.json",))
    one_error(*call_main("export.__main__", ["parity", run], capsys), ("manifest.json",))
    (out / "manifest.json").write_text('{"files": {}}', encoding="utf-8")  # JSON, but not a manifest
    before = tree_digest(run)
    line = one_error(*call_main("export.__main__", ["parity", run], capsys), ("manifest.json",))
    assert "'source'" in line
    assert tree_digest(run) == before


def test_export_all_checks_every_target_before_writing_any(rel_run, tmp_path, capsys):  # noqa: F811
    """`export all` with an ONNX file already there refuses before hf/ is written, not after."""
    run = _copy_run(rel_run, tmp_path / "run")
    onnx = run / "export" / "onnx"
    onnx.mkdir(parents=True)
    (onnx / "model.onnx").write_bytes(b"an earlier export")
    before = tree_digest(run)
    one_error(*call_main("export.__main__", ["all", run, "--no-parity"], capsys), ("model.onnx",))
    assert tree_digest(run) == before and not (run / "export" / "hf").exists()


def test_export_names_a_bad_texts_file_and_out(rel_run, tmp_path, capsys):  # noqa: F811
    run = _copy_run(rel_run, tmp_path / "run")
    binary = tmp_path / "texts.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    a_file = tmp_path / "out-is-a-file"
    a_file.write_text("keep\n", encoding="utf-8")
    before = tree_digest(run)
    one_error(*call_main("export.__main__", ["gguf", run, "--f32", "--texts", binary], capsys), ("--texts",))
    one_error(*call_main("export.__main__", ["gguf", run, "--f32", "--no-parity", "--out", a_file], capsys),
                     ("--out",))
    assert tree_digest(run) == before and a_file.read_text(encoding="utf-8") == "keep\n"


def test_export_evaluate_checks_its_paths_before_scoring(rel_gguf, tmp_path, capsys):  # noqa: F811
    text = tmp_path / "বাংলা লেখা.txt"
    text.write_text("আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।\n", encoding="utf-8")
    a_file = tmp_path / "eval-out"
    a_file.write_text("keep\n", encoding="utf-8")
    base = [rel_gguf, "--text", text, "--no-progress", "--threads", "1"]
    one_error(*call_main("export.evaluate", [*base, "--out", a_file], capsys), ("--out",))
    one_error(*call_main("export.evaluate", [*base, "--reference", tmp_path / "no run"], capsys), ("--reference",))
    assert a_file.read_text(encoding="utf-8") == "keep\n"
    rc, out, err = call_main("export.evaluate", [*base, "--n-ctx", "32", "--out", tmp_path / "ফলাফল"], capsys)
    assert rc == 0 and (tmp_path / "ফলাফল" / "eval.json").is_file(), err


def test_serving_names_a_garbage_onnx_config(tmp_path, capsys):
    folder = tmp_path / "onnx"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"not a model")
    (folder / "onnx_config.json").write_text("{truncated", encoding="utf-8")
    before = tree_digest(folder)
    one_error(*call_main("serving.__main__", [folder, "--prompt", "x"], capsys), ("onnx_config.json",))
    assert tree_digest(folder) == before


# ----------------------------------------------------------------------------- servers: bind first
@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("bind", ["busy", "nosuchhost.invalid:8000", "192.0.2.1:8000"])
def test_server_fails_before_it_announces(bind, busy_port, rel_run, capsys, monkeypatch):  # noqa: F811
    """A real model, but the address is refused before it loads: the model is never loaded (the event,
    not a time limit a loaded machine or a slow DNS answer could break), one line, never "serving on"."""
    import serving.__main__ as cli

    loads = []
    monkeypatch.setattr(cli, "load", lambda *a, **k: loads.append(a) or serving_load(*a, **k))
    spec = f"127.0.0.1:{busy_port}" if bind == "busy" else bind
    rc, out, err = call_main("serving.__main__", [rel_run, "--http", spec, "--threads", "1"], capsys)
    line = one_error(rc, out, err, ("--http",))
    assert "serving on" not in out + err and loads == [], (loads, err)
    assert ("already in use" if bind == "busy" else "nosuchhost" if "nosuch" in bind else "address") in line


def test_reserve_socket_holds_the_port(busy_port):
    from serving.backend import ServingError
    from serving.server.http_app import bound_port, reserve_socket

    sock = reserve_socket("127.0.0.1", 0)
    try:
        port = bound_port(sock)
        assert 0 < port <= 65535
        with pytest.raises(ServingError, match=f"{port} is already in use"):
            reserve_socket("127.0.0.1", port).close()
    finally:
        sock.close()
    with pytest.raises(ServingError, match="--port .*already in use"):
        reserve_socket("127.0.0.1", busy_port, flag="--port")


def test_server_busy_port_subprocess(busy_port, tmp_path):
    r = run_cli([sys.executable, "-m", "serving", str(tmp_path / "no model.gguf"), "--http", str(busy_port)],
                timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and lines == [x for x in lines if x.startswith("error: --http")] and len(lines) == 1, \
        r.stderr


# ------------------------------------------------------------------------------------ HTTP bodies


CHAT = {"messages": [{"role": "user", "content": "নমস্কার"}], "max_tokens": 2}


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("temperature", "0.5", "temperature"), ("temperature", -0.1, "temperature"), ("temperature", 11, "temperature"),
    ("top_p", 0, "top_p"), ("top_p", 1.01, "top_p"), ("top_p", True, "top_p"), ("top_k", -1, "top_k"),
    ("top_k", 1.5, "top_k"), ("max_tokens", 9, "max_tokens"), ("max_tokens", 2.0, "max_tokens"),
    ("max_completion_tokens", 0, "max_completion_tokens"), ("seed", 2**64, "seed"), ("seed", -3, "seed"),
    ("repeat_penalty", 0, "repeat_penalty"), ("temprature", 0.5, "did you mean 'temperature'"),
    ("frequency_penalty", 0.5, "frequency_penalty"), ("n", 2, "n=1"), ("logprobs", True, "logprobs"),
])
def test_bad_body_is_a_one_line_400(client, field, value, needle):
    r = client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert needle in msg and "\n" not in msg, msg
    assert client.get("/health").json()["status"] == "ok"


def test_good_body_with_openai_labels_is_served(client):
    body = {**CHAT, "model": "t", "user": "u", "n": 1, "frequency_penalty": 0, "seed": 2**63 - 1, "top_p": 1,
            "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    r = client.post("/v1/completions", json={"prompt": "আমার", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------- valid paths: spaces and Bangla
def test_spaces_and_bangla_in_paths_still_work(rel_run, tmp_path, capsys):  # noqa: F811
    root = tmp_path / "আমার ফোল্ডার" / "রান এক"
    run = _copy_run(rel_run, root)
    rc, out, err = call_main("export.__main__", ["gguf", run, "--f32", "--no-parity"], capsys)
    assert rc == 0, err
    ggufs = list((run / "export" / "gguf").glob("*-F32.gguf"))
    assert len(ggufs) == 1, out
    rc, out, err = call_main("serving.__main__", [ggufs[0], "--prompt", "নমস্কার", "--max-tokens", "2",
                                             "--temperature", "0", "--threads", "1"], capsys)
    assert rc == 0 and "error" not in err, err
    corpus = tmp_path / "কর্পাস ফাইল" / "bn text.txt"
    corpus.parent.mkdir()
    shutil.copy(sorted(CORPUS.glob("bn_*.txt"))[0], corpus)
    rc, out, err = call_main("training.prepare.prepare_cli", ["--input", corpus, "--out", tmp_path / "ডেটা আউট", "--vocab-size",
                                                 "400", "--workers", "1", "--no-progress", "--skip-gate",
                                                 "tokenizer.fertility", "--skip-gate", "tokenizer.balance"], capsys)
    assert rc == 0, err
    assert (tmp_path / "ডেটা আউট" / "meta.json").is_file()

"""Hostile inputs, exposure and load: a bad file or a curious visitor never costs a run or a machine.

1. One table of bad inputs across the CLIs (prepare, train, export, serving, demo), each run as a
   user runs it: exit status != 0, exactly one `error:` line that says what is wrong (and no
   traceback), and every file that existed before is byte-identical after.
2. The same for an HTTP client of `python -m serving --http`: one-line 4xx errors, server alive.
3. Exposure: the server and the demo bind 127.0.0.1 by default, the demo opens no share link, and
   the request size and max_tokens are capped.
4. Load (the smaller sibling of tests/benchmarks/bench_load.py): concurrent multi-turn clients
   against the HTTP server and the Gradio demo over a llama.cpp model: zero errors, bounded memory,
   and llama.cpp is never entered by two requests at once.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import stop
from fixtures_reliability import (
    N_CTX,
    REPO,
    EntryGuard,
    child_env,
    run_cli,
    train_argv,
    tree_digest,
)

from training.checkpoint import checkpoint_io as ckpt
from training.data.loaders import HEADER, HEADER_SIZE
from training.runfiles import layout

PY = sys.executable
RUNTIME_LOG = ("llama_context:",)  # llama.cpp's own log (it pads small contexts to 256 and says so)
PARALLEL_CLIS = 3
LONG_PROMPT = "আমাদের গ্রামের পাশ দিয়ে একটি ছোট নদী বয়ে গেছে। " * 120  # thousands of tokens
SEED = 7


@dataclass
class Artifacts:
    data: Path  # a prepared DATA_DIR (read-only: cases copy it)
    run: Path  # a RUN_DIR written by train.py, checkpoints at steps 2 and 4
    gguf: Path
    foreign_tok: Path  # same vocab size, other ids
    small_tok: Path  # another vocab size
    foreign_data: Path  # DATA_DIR prepared with foreign_tok


Setup = Callable[[Artifacts, Path], tuple[list[str], list[Path]]]  # -> (argv, paths that must not change)


# ------------------------------------------------------------------------------------------ helpers
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return dst


def _shard(data: Path) -> Path:
    return sorted((data / "train").glob("shard_*.bin"))[0]


def _patch_header(path: Path, **fields: object) -> None:
    """Rewrite chosen fields of a token shard's header (magic, version, itemsize, n, vocab, sha)."""
    raw = path.read_bytes()
    names = ("magic", "version", "itemsize", "n", "vocab", "reserved", "sha")
    vals = dict(zip(names, HEADER.unpack(raw[:HEADER.size]), strict=True))
    vals.update(fields)
    head = HEADER.pack(*(vals[n] for n in names)).ljust(HEADER_SIZE, b"\0")
    path.write_bytes(head + raw[HEADER_SIZE:])


def _truncate(path: Path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def _newest(run: Path) -> Path:
    return ckpt.latest(run)


def _train(a: Artifacts, data: Path, out: Path, *extra: str) -> list[str]:
    return train_argv(data, out, *extra, steps=6)


def _serve(model: Path, *extra: str) -> list[str]:
    return [PY, "-m", "serving", str(model), "--prompt", "নমস্কার", "--max-tokens", "4", *extra]


# ------------------------------------------------------------------------------------------- prepare
def prep_missing(a, d):
    return [PY, "-m", "training.prepare", "--input", str(d / "nope.txt"), "--out", str(d / "data")], []


def prep_empty(a, d):
    (d / "empty.txt").write_text("")
    return [PY, "-m", "training.prepare", "--input", str(d / "empty.txt"), "--out", str(d / "data")], [d / "empty.txt"]


def prep_binary(a, d):
    (d / "blob.txt").write_bytes(random.Random(SEED).randbytes(50_000))
    return [PY, "-m", "training.prepare", "--input", str(d / "blob.txt"), "--out", str(d / "data")], [d / "blob.txt"]


def prep_non_utf8(a, d):
    (d / "latin1.txt").write_bytes("Ça coûte très cher, déjà vu à Bogotá.\n\n".encode("latin-1") * 50)
    return [PY, "-m", "training.prepare", "--input", str(d / "latin1.txt"), "--out", str(d / "data"), "--strict"], [
        d / "latin1.txt"]


def prep_bad_gzip(a, d):
    (d / "corpus.txt.gz").write_bytes(b"\x1f\x8b\x08\x00" + random.Random(SEED).randbytes(4000))
    return [PY, "-m", "training.prepare", "--input", str(d / "corpus.txt.gz"), "--out", str(d / "data"),
            "--strict"], [d / "corpus.txt.gz"]


def prep_empty_folder(a, d):
    (d / "in").mkdir()
    return [PY, "-m", "training.prepare", "--input", str(d / "in"), "--out", str(d / "data")], []


def prep_out_exists(a, d):
    data = _copy(a.data, d / "data")
    (d / "in.txt").write_text("আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।\n" * 20, encoding="utf-8")
    return [PY, "-m", "training.prepare", "--input", str(d / "in.txt"), "--out", str(data)], [data]


def prep_bad_vocab(a, d):
    (d / "in.txt").write_text("আমার সোনার বাংলা\n", encoding="utf-8")
    return [PY, "-m", "training.prepare", "--input", str(d / "in.txt"), "--out", str(d / "data"),
            "--vocab-size", "0"], []


def prep_bad_tokenizer(a, d):
    (d / "in.txt").write_text("আমার সোনার বাংলা\n", encoding="utf-8")
    (d / "tok.model").write_bytes(b"this is not a sentencepiece model")
    return [PY, "-m", "training.prepare", "--input", str(d / "in.txt"), "--out", str(d / "data"),
            "--tokenizer", str(d / "tok.model")], [d / "tok.model"]


# --------------------------------------------------------------------------------------------- train
def train_missing_data(a, d):
    return _train(a, d / "nope", d / "run"), []


def train_not_prepared(a, d):
    (d / "data").mkdir()
    (d / "data" / "notes.txt").write_text("hello")
    return _train(a, d / "data", d / "run"), [d / "data"]


def _bad_data(a, d, damage) -> tuple[list[str], list[Path]]:
    data = _copy(a.data, d / "data")
    damage(data)
    return _train(a, data, d / "run"), [data]


def train_truncated_shard(a, d):
    return _bad_data(a, d, lambda data: _truncate(_shard(data), 0.7))


def train_shard_header_cut(a, d):
    return _bad_data(a, d, lambda data: _shard(data).write_bytes(_shard(data).read_bytes()[:20]))


def train_shard_magic(a, d):
    return _bad_data(a, d, lambda data: _patch_header(_shard(data), magic=b"NOTMINE!"))


def train_shard_dtype(a, d):
    return _bad_data(a, d, lambda data: _patch_header(_shard(data), itemsize=3))


def train_shard_vocab(a, d):
    return _bad_data(a, d, lambda data: _patch_header(_shard(data), vocab=32000))


def train_shard_tokenizer(a, d):
    return _bad_data(a, d, lambda data: _patch_header(_shard(data), sha=bytes(32)))


def train_data_tokenizer_swapped(a, d):
    return _bad_data(a, d, lambda data: shutil.copy(a.foreign_tok, data / "tokenizer.model"))


def train_out_other_run(a, d):
    run = _copy(a.run, d / "run")
    return _train(a, a.data, run, "--set", "d_model=128"), [run]


def train_out_not_a_run(a, d):
    (d / "mine").mkdir()
    (d / "mine" / "thesis.tex").write_text("years of work")
    return _train(a, a.data, d / "mine"), [d / "mine"]


def train_out_unreadable_config(a, d):
    run = _copy(a.run, d / "run")
    cfg = run / layout.RUN_CONFIG
    (cfg if cfg.is_file() else run / layout.LEGACY_RUN_CONFIG).write_text("{ not json")  # whichever the run holds
    return _train(a, a.data, run), [run]


def train_resume_other_tokenizer(a, d):
    run = _copy(a.run, d / "run")
    return _train(a, a.foreign_data, run), [run]


def train_resume_truncated_checkpoint(a, d):
    run = _copy(a.run, d / "run")
    _truncate(_newest(run) / ckpt.MODEL_FILE)
    return train_argv(a.data, run), [run]  # the run's own command (train.py rewrites config.json on start)


def train_seq_too_long(a, d):
    return _train(a, a.data, d / "run", "--seq-len", str(4 * N_CTX)), []


def train_bad_set(a, d):
    return _train(a, a.data, d / "run", "--set", "n_layers"), []


# -------------------------------------------------------------------------------------------- export
def _export(path: Path, *extra: str) -> list[str]:
    return [PY, "-m", "export", "safetensors", str(path), "--no-parity", *extra]


def export_missing(a, d):
    return _export(d / "nope"), []


def _bad_ckpt(a, d, damage) -> tuple[Path, list[Path]]:
    run = _copy(a.run, d / "run")
    damage(_newest(run))
    return run, [run]


def export_truncated_safetensors(a, d):
    run, keep = _bad_ckpt(a, d, lambda c: _truncate(c / ckpt.MODEL_FILE, 0.6))
    return _export(run), keep


def _corrupt_header(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    raw[8:8 + n] = b"#" * n  # the JSON header turned to garbage, size kept
    f.write_bytes(bytes(raw))


def export_corrupted_safetensors(a, d):
    run, keep = _bad_ckpt(a, d, lambda c: _corrupt_header(c / ckpt.MODEL_FILE))
    return _export(run), keep


def export_tokenizer_mismatch(a, d):
    run, keep = _bad_ckpt(a, d, lambda c: shutil.copy(a.foreign_tok, c / ckpt.TOKENIZER_FILE))
    return _export(run), keep


def export_tokenizer_vocab(a, d):
    run, keep = _bad_ckpt(a, d, lambda c: shutil.copy(a.small_tok, c / ckpt.TOKENIZER_FILE))
    return _export(run), keep


def export_other_manifest(a, d):
    run = _copy(a.run, d / "run")
    (run / "export").mkdir()
    (run / "export" / "manifest.json").write_text(json.dumps(
        {"source": {"checkpoint": "/elsewhere/run/checkpoints/step_0000100", "step": 100}, "files": {}}))
    (run / "export" / "model.safetensors").write_bytes(b"someone else's export")
    return _export(run), [run]


def export_bad_threshold(a, d):
    return [PY, "-m", "export", "parity", str(a.run), "--threshold", "kl"], []


def export_new_tokens_zero(a, d):
    return [PY, "-m", "export", "parity", str(a.run), "--new-tokens", "0"], []


# ------------------------------------------------------------------------------------------- serving
def serve_missing(a, d):
    return _serve(d / "nope.gguf"), []


def _foreign_gguf(path: Path) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def serve_gguf_other_arch(a, d):
    _foreign_gguf(d / "gpt2-F32.gguf")
    return _serve(d / "gpt2-F32.gguf"), [d / "gpt2-F32.gguf"]


def serve_gguf_truncated(a, d):
    f = _copy(a.gguf, d / "model-F32.gguf")
    _truncate(f, 0.5)
    return _serve(f), [f]


def serve_gguf_not_gguf(a, d):
    (d / "model.gguf").write_bytes(b"GGUF" + random.Random(SEED).randbytes(2000))
    return _serve(d / "model.gguf"), [d / "model.gguf"]


def _foreign_onnx(folder: Path, a: Artifacts) -> None:
    """A prodip-looking ONNX folder (config + our tokenizer) holding another model's graph."""
    import onnx
    from onnx import TensorProto, helper

    from serving.backends import onnxrt_backend as onnxrt
    from training.text.tokenizer import Tokenizer

    folder.mkdir()
    tok = Tokenizer.load(a.run / "tokenizer.model")
    graph = helper.make_graph([helper.make_node("Relu", ["pixels"], ["scores"])], "mnist-ish",
                              [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [1, 784])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 784])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "model.onnx")
    cfg = json.loads((_newest(a.run) / ckpt.CONFIG_FILE).read_text())
    (folder / onnxrt.CONFIG_FILE).write_text(json.dumps({
        "format": onnxrt.FORMAT, "format_version": onnxrt.FORMAT_VERSION, "files": {"fp32": "model.onnx"},
        "n_layers": cfg["n_layers"], "n_kv_heads": cfg["n_kv_heads"], "head_dim": cfg["d_model"] // cfg["n_heads"],
        "vocab_size": tok.vocab_size, "max_seq_len": cfg["max_seq_len"], "tokenizer_sha256": tok.sha256}))
    tok.save(folder / onnxrt.TOKENIZER_FILE)


def serve_onnx_other_model(a, d):
    _foreign_onnx(d / "onnx", a)
    return _serve(d / "onnx" / "model.onnx"), [d / "onnx"]


def serve_prompt_too_long(a, d):
    return [PY, "-m", "serving", str(a.run), "--prompt", LONG_PROMPT, "--max-tokens", "4"], []


def serve_gguf_prompt_too_long(a, d):
    return [PY, "-m", "serving", str(a.gguf), "--prompt", LONG_PROMPT * 3, "--max-tokens", "4"], []


def serve_temperature(a, d):
    return _serve(a.run, "--temperature", "-1"), []


def serve_top_p(a, d):
    return _serve(a.run, "--top-p", "0"), []


def serve_max_tokens(a, d):
    return [PY, "-m", "serving", str(a.run), "--prompt", "নমস্কার", "--max-tokens", "0"], []


def serve_nan_temperature(a, d):
    return _serve(a.run, "--temperature", "nan"), []


def serve_bad_port(a, d):
    return [PY, "-m", "serving", str(a.run), "--http", "70000"], []


def serve_truncated_checkpoint(a, d):
    run, keep = _bad_ckpt(a, d, lambda c: _truncate(c / ckpt.MODEL_FILE, 0.3))
    return _serve(run), keep


def serve_tokenizer_mismatch(a, d):
    run, keep = _bad_ckpt(a, d, lambda c: shutil.copy(a.foreign_tok, c / ckpt.TOKENIZER_FILE))
    return _serve(run), keep


# ---------------------------------------------------------------------------------------------- demo
def demo_missing(a, d):
    return [PY, "-m", "demo", "--model", str(d / "nope.gguf"), "--port", "0"], []


def demo_gguf_other_arch(a, d):
    _foreign_gguf(d / "gpt2-F32.gguf")
    return [PY, "-m", "demo", "--model", str(d / "gpt2-F32.gguf"), "--port", "0"], [d / "gpt2-F32.gguf"]


# ---------------------------------------------------------------------------------------- quickstart
def _quickstart(d: Path, *extra: str) -> list[str]:
    return [PY, "-m", "demo.quickstart", "--out", str(d / "qs"), "--no-demo", *extra]


def quickstart_missing_corpus(a, d):
    return _quickstart(d, "--corpus", str(d / "nope.txt")), []


def quickstart_missing_chat(a, d):
    return _quickstart(d, "--chat", str(d / "nope.jsonl")), []


def quickstart_zero_steps(a, d):
    return _quickstart(d, "--steps", "0"), []


def quickstart_stage_fails(a, d):
    """prepare refuses an empty corpus: its own error line, then the quickstart names the stage."""
    (d / "empty.txt").write_text("")
    return _quickstart(d, "--corpus", str(d / "empty.txt")), [d / "empty.txt"]


CASES: list[tuple[str, Setup, str]] = [
    ("prepare-missing-corpus", prep_missing, "input not found"),
    ("prepare-empty-corpus", prep_empty, "no documents found"),
    ("prepare-binary-corpus", prep_binary, "unreadable file"),
    ("prepare-non-utf8-corpus", prep_non_utf8, "not UTF-8"),
    ("prepare-bad-gzip", prep_bad_gzip, "bad gzip"),
    ("prepare-empty-folder", prep_empty_folder, "has no files"),
    ("prepare-out-exists", prep_out_exists, "--force"),
    ("prepare-vocab-zero", prep_bad_vocab, "--vocab-size"),
    ("prepare-bad-tokenizer", prep_bad_tokenizer, "not a SentencePiece model"),
    ("train-missing-data", train_missing_data, "data directory not found"),
    ("train-not-prepared", train_not_prepared, "not a prepared data directory"),
    ("train-truncated-shard", train_truncated_shard, "truncated"),
    ("train-shard-header-cut", train_shard_header_cut, "truncated shard header"),
    ("train-shard-bad-magic", train_shard_magic, "not a prodip token shard"),
    ("train-shard-dtype", train_shard_dtype, "unknown token dtype"),
    ("train-shard-vocab", train_shard_vocab, "vocab size"),
    ("train-shard-tokenizer", train_shard_tokenizer, "another tokenizer"),
    ("train-data-tokenizer-swapped", train_data_tokenizer_swapped, "does not match"),
    ("train-out-other-run", train_out_other_run, "another model config"),
    ("train-out-not-a-run", train_out_not_a_run, "not a prodip run folder"),
    ("train-out-unreadable-config", train_out_unreadable_config, "unreadable"),
    ("train-resume-other-tokenizer", train_resume_other_tokenizer, "another tokenizer"),
    ("train-resume-truncated-checkpoint", train_resume_truncated_checkpoint, "truncated or corrupted"),
    ("train-seq-too-long", train_seq_too_long, "max_seq_len"),
    ("train-bad-set", train_bad_set, "KEY=VALUE"),
    ("export-missing", export_missing, "not found"),
    ("export-truncated-safetensors", export_truncated_safetensors, "truncated or corrupted"),
    ("export-corrupted-safetensors", export_corrupted_safetensors, "truncated or corrupted"),
    ("export-tokenizer-mismatch", export_tokenizer_mismatch, "does not match the tokenizer"),
    ("export-tokenizer-vocab", export_tokenizer_vocab, "tokenizer has"),
    ("export-other-manifest", export_other_manifest, "another checkpoint"),
    ("export-bad-threshold", export_bad_threshold, "bad threshold"),
    ("export-new-tokens-zero", export_new_tokens_zero, "--new-tokens"),
    ("serve-missing", serve_missing, "not found"),
    ("serve-gguf-other-arch", serve_gguf_other_arch, "architecture 'gpt2'"),
    ("serve-gguf-truncated", serve_gguf_truncated, "GGUF"),
    ("serve-gguf-garbage", serve_gguf_not_gguf, "GGUF"),
    ("serve-onnx-other-model", serve_onnx_other_model, "do not match"),
    ("serve-prompt-too-long", serve_prompt_too_long, "context"),
    ("serve-gguf-prompt-too-long", serve_gguf_prompt_too_long, "context"),
    ("serve-temperature", serve_temperature, "temperature"),
    ("serve-nan-temperature", serve_nan_temperature, "temperature"),
    ("serve-top-p", serve_top_p, "--top-p"),
    ("serve-max-tokens", serve_max_tokens, "--max-tokens"),
    ("serve-bad-port", serve_bad_port, "port"),
    ("serve-truncated-checkpoint", serve_truncated_checkpoint, "truncated or corrupted"),
    ("serve-tokenizer-mismatch", serve_tokenizer_mismatch, "does not match"),
    ("demo-missing-model", demo_missing, "not found"),
    ("demo-gguf-other-arch", demo_gguf_other_arch, "architecture 'gpt2'"),
    ("quickstart-missing-corpus", quickstart_missing_corpus, "input not found"),
    ("quickstart-missing-chat", quickstart_missing_chat, "input not found"),
    ("quickstart-zero-steps", quickstart_zero_steps, "argument --steps"),
]


@pytest.fixture(scope="module")
def artifacts(bn_data, rel_run, rel_gguf, foreign_tokenizer, tmp_path_factory) -> Artifacts:  # noqa: F811
    from training.prepare import GATE_NAMES, prepare
    from training.text.normalization import normalize
    from training.text.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("hostile-artifacts")
    lines = [normalize(x) for f in sorted((REPO / "training" / "assets" / "corpus").glob("bn_*.txt"))
             for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    small = root / "small.model"
    train_tokenizer(lines, 512, num_threads=1).save(small)
    foreign_data = root / "foreign-data"
    inputs = sorted((REPO / "training" / "assets" / "corpus").glob("bn_*.txt"))
    prepare(inputs, foreign_data, tokenizer=foreign_tokenizer, progress=False, workers=1, skip_gates=list(GATE_NAMES))
    return Artifacts(bn_data, rel_run, rel_gguf, foreign_tokenizer, small, foreign_data)


@pytest.fixture(scope="module")
def outcomes(artifacts, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, dict, dict]]:
    """Every case set up, run (a few at a time: each is a cold CLI start), and its files re-read."""
    prepared = {}
    for cid, setup, _ in CASES:
        d = tmp_path_factory.mktemp(cid)
        argv, protect = setup(artifacts, d)
        prepared[cid] = (argv, protect, {str(p): tree_digest(p) for p in protect})

    def go(cid: str):
        argv, protect, before = prepared[cid]
        r = run_cli(argv)
        return cid, (r, before, {str(p): tree_digest(p) for p in protect})

    shared = {str(p): tree_digest(p) for p in (artifacts.run, artifacts.data, artifacts.gguf)}
    with ThreadPoolExecutor(PARALLEL_CLIS) as pool:
        done = dict(pool.map(go, prepared))
    assert {str(p): tree_digest(p) for p in (artifacts.run, artifacts.data, artifacts.gguf)} == shared
    return done


def test_the_table_is_large_enough():
    assert len(CASES) >= 30 and len({c for c, _, _ in CASES}) == len(CASES)
    assert {c.split("-")[0] for c, _, _ in CASES} == {"prepare", "train", "export", "serve", "demo", "quickstart"}


@pytest.mark.parametrize("cid,needle", [(c, n) for c, _, n in CASES], ids=[c for c, _, _ in CASES])
def test_hostile_input_is_one_clear_line(outcomes, cid, needle):
    r, before, after = outcomes[cid]
    err = [x for x in r.stderr.splitlines() if x.strip()]
    detail = f"rc {r.returncode}\nstderr:\n{r.stderr[-3000:]}\nstdout:\n{r.stdout[-1500:]}"
    assert r.returncode != 0, detail
    assert "Traceback" not in r.stderr, detail
    errors = [x for x in err if x.startswith("error: ")]
    # besides the one error: warning and note lines (documented, e.g. serving's "base model" note) only
    others = [x for x in err if not x.startswith(("error: ", "warning: ", "note: ", *RUNTIME_LOG)) and "%|" not in x]
    assert len(errors) == 1 and not others, f"expected exactly one `error:` line\n{detail}"
    assert needle in errors[0], detail
    for p, digest in before.items():
        assert after[p] == digest, f"{p} changed"


def test_quickstart_names_the_failed_stage(artifacts, tmp_path):
    """A stage's own `error:` line comes first; the quickstart's last line names the stage, exit 2."""
    argv, keep = quickstart_stage_fails(artifacts, tmp_path)
    before = tree_digest(keep[0])
    r = run_cli(argv)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "error: no documents found" in r.stderr and last.startswith("error: prepare failed"), r.stderr[-3000:]
    assert tree_digest(keep[0]) == before


def test_debug_shows_the_traceback(artifacts, tmp_path):
    argv, _ = train_shard_magic(artifacts, tmp_path)
    r = run_cli([*argv, "--debug"])
    assert r.returncode != 0 and "Traceback" in r.stderr and "not a prodip token shard" in r.stderr


# ------------------------------------------------------------------------------------- HTTP clients
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


MAX_BODY = 4096
TOKENS_CAP = 16


@pytest.fixture(scope="module")
def http_server(rel_run, tmp_path_factory):  # noqa: F811
    """`python -m serving RUN --http PORT` with small caps, as a user starts it (default host)."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("http") / "server.log", "w+")  # noqa: SIM115
    p = subprocess.Popen([PY, "-m", "serving", str(rel_run), "--http", str(port), "--max-body-bytes", str(MAX_BODY),
                          "--max-tokens-cap", str(TOKENS_CAP)], cwd=REPO, env=child_env(), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/health", p)
        yield url, port
    finally:
        stop(p)
        log.close()


def _chat(content: str, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}).encode()


HTTP_CASES = [  # (id, path, raw body, status, expected substring)
    ("invalid-utf8", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}', 400,
     "not valid UTF-8"),
    ("lone-surrogate", "/v1/chat/completions", _chat("\ud800"), 400, "lone surrogate"),
    ("invalid-json", "/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
    ("not-an-object", "/v1/completions", b'["prompt"]', 400, "JSON object"),
    ("body-too-large", "/v1/completions", json.dumps({"prompt": "ক" * MAX_BODY}).encode(), 413, "limit"),
    ("max-tokens-over-cap", "/v1/chat/completions", _chat("হ্যালো", max_tokens=TOKENS_CAP + 1), 400, "max_tokens"),
    ("temperature-negative", "/v1/chat/completions", _chat("হ্যালো", temperature=-1), 400, "temperature"),
    ("top-p-zero", "/v1/completions", json.dumps({"prompt": "আমি", "top_p": 0}).encode(), 400, "top_p"),
    ("top-k-string", "/v1/completions", json.dumps({"prompt": "আমি", "top_k": "all"}).encode(), 400, "top_k"),
    ("prompt-longer-than-context", "/v1/completions", json.dumps({"prompt": LONG_PROMPT[:400]}).encode(), 400,
     "context"),
    ("chat-longer-than-context", "/v1/chat/completions", _chat(LONG_PROMPT[:400]), 400, "context"),
    ("no-messages", "/v1/chat/completions", b'{"messages": []}', 400, "messages"),
]


@pytest.mark.parametrize("cid,path,body,status,needle", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_hostile_http_request_is_one_clear_line(http_server, cid, path, body, status, needle):
    url, _ = http_server
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert needle in msg and "\n" not in msg and "Traceback" not in r.text, msg
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # and the server is still there


# ----------------------------------------------------------------------------------------- exposure
def _external_ip() -> str | None:
    """This machine's address on its default route (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net/tcp{,6} spell them


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as the kernel lists them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


def test_server_binds_loopback_only_by_default(http_server):
    _, port = http_server
    assert _reachable("127.0.0.1", port)
    listening = _listening_addresses(port)
    assert listening and listening <= LOOPBACK_HEX, f"the server listens on {listening}: it must bind 127.0.0.1"
    ip = _external_ip()  # and, where the machine has another address, it does not answer there
    assert ip is None or not _reachable(ip, port), f"the server answers on {ip}: it must bind 127.0.0.1 unless asked"


def test_demo_defaults_are_private(rel_gguf):  # noqa: F811
    from demo.__main__ import build_parser
    from demo.app import MAX_MESSAGE_CHARS, MAX_TOKENS_LIMIT, build_app, launch
    from demo.models import discover_models

    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.share is False
    app, pool = build_app(discover_models(rel_gguf))
    port = _free_port()
    try:
        url = launch(app, port=port, block=False, quiet=True)
        assert url.startswith("http://127.0.0.1:") and app.share_url is None
        assert _reachable("127.0.0.1", port)
        listening = _listening_addresses(port)
        assert listening and listening <= LOOPBACK_HEX, f"the demo listens on {listening}"
        ip = _external_ip()
        if ip is not None:
            assert not _reachable(ip, port), f"the demo answers on {ip}"
        from gradio_client import Client

        client = Client(url, verbose=False, download_files=False, httpx_kwargs={"timeout": 600})
        with pytest.raises(Exception, match="খুব লম্বা"):  # message too long, refused before tokenizing
            client.predict("ক" * (MAX_MESSAGE_CHARS + 1), [], next(iter(pool.entries)), 8, 0.0, 0, 1.0, 1.0, 0,
                           api_name="/chat")
        assert MAX_TOKENS_LIMIT <= 4096
    finally:
        app.close()
        pool.close()


# --------------------------------------------------------------------------------------------- load
def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


LOAD_CLIENTS, LOAD_TURNS, LOAD_TOKENS = 8, 3, 6
RSS_GROWTH_MB = 300


def test_http_under_concurrent_clients(rel_gguf):  # noqa: F811
    import uvicorn

    from serving import load
    from serving.server.http_app import ServerConfig, create_app

    backend = load(rel_gguf, threads=1)
    guard = backend.llm = EntryGuard(backend.llm)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(backend, ServerConfig(model_id="t")), host="127.0.0.1", port=port,
                                        log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    errors: list[str] = []
    try:
        _wait_http(url + "/health")
        rss0 = _rss_mb()

        def client(i: int) -> None:
            history = []
            with httpx.Client(base_url=url, timeout=300) as c:
                for t in range(LOAD_TURNS):
                    history.append({"role": "user", "content": f"প্রশ্ন {i}.{t}: আজকের আবহাওয়া কেমন?"})
                    r = c.post("/v1/chat/completions", json={"messages": history, "max_tokens": LOAD_TOKENS,
                                                             "temperature": 0.7, "seed": i, "stream": t % 2 == 1})
                    if r.status_code != 200:
                        errors.append(f"{i}.{t}: {r.status_code} {r.text[:200]}")
                        return
                    if t % 2 == 1:
                        text = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content", "")
                                       for x in r.text.splitlines() if x.startswith("data: {"))
                    else:
                        text = r.json()["choices"][0]["message"]["content"]
                    history.append({"role": "assistant", "content": text or "…"})

        with ThreadPoolExecutor(LOAD_CLIENTS) as pool:
            list(pool.map(client, range(LOAD_CLIENTS)))
        growth = _rss_mb() - rss0
    finally:
        srv.should_exit = True
        th.join(timeout=30)
        backend.close()
    assert not errors, errors
    assert guard.entries > LOAD_CLIENTS * LOAD_TURNS and guard.max_active == 1, vars(guard)
    assert growth < RSS_GROWTH_MB, f"RSS grew {growth:.0f} MB"


def test_demo_under_concurrent_clients(rel_gguf):  # noqa: F811
    from gradio_client import Client

    from demo.app import build_app, launch
    from demo.models import discover_models

    entries = discover_models(rel_gguf)
    app, pool = build_app(entries[:1], threads=1)
    backend, _ = pool.get(entries[0].label)
    guard = backend.llm = EntryGuard(backend.llm)
    errors: list[str] = []
    try:
        url = launch(app, port=_free_port(), block=False, quiet=True)

        def client(i: int) -> None:
            c = Client(url, verbose=False, download_files=False, httpx_kwargs={"timeout": 600})
            history: list = []
            for t in range(2):
                try:
                    _, history, _ = c.predict(f"প্রশ্ন {i}.{t}", history, entries[0].label, LOAD_TOKENS, 0.7, 40, 0.95,
                                              1.1, i, api_name="/chat")
                except Exception as e:  # noqa: BLE001 (a load test counts every failure)
                    errors.append(f"{i}.{t}: {e}")
                    return
            if len(history) != 4:
                errors.append(f"{i}: history has {len(history)} messages")

        with ThreadPoolExecutor(4) as ex:
            list(ex.map(client, range(4)))
    finally:
        app.close()
        pool.close()
    assert not errors, errors
    assert guard.entries >= 8 and guard.max_active == 1, vars(guard)


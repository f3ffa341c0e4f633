"""Streamed text never shows U+FFFD (issue 31): a real model forced to emit byte-fallback tokens.

The model is a real prodip checkpoint (training.model.decoder, saved by training.checkpoint.checkpoint_io) whose weights make
greedy decoding follow a fixed cycle of tokens, whatever the prompt:

    আ  <0xE2> <0x82> <0xAC>  <0xE0>  ম    (then আ again)

so its bytes are "আ", "€" split over three byte tokens (held back until complete), a lone lead byte E0
that the next token makes invalid (dropped and counted), and "ম". How: one layer whose attention and
feed-forward outputs are zero, so the final hidden state is the current token's embedding; each token
of the cycle has its own embedding axis (every other token shares axis 0) and the output row of its
successor points along that axis. The same stream code serves the PyTorch runtime, llama.cpp (the
checkpoint exported to GGUF), the HTTP server and `python -m serving`.
"""

from __future__ import annotations

import json
import os
import sys

import preloaded
import pytest
import torch
from conftest import REPO
from fastapi.testclient import TestClient

from serving import SamplingParams, load
from serving.chat_session import completion_stream
from serving.server.http_app import ServerConfig, create_app
from serving.text_stream import text_decoder
from training.checkpoint import checkpoint_io as checkpoint
from training.model.decoder import ModelConfig, Transformer
from training.runfiles import layout
from training.text.tokenizer import Tokenizer
from training.text.wellformed import REPLACEMENT, Utf8Text, decode_utf8, wellformed

CYCLE_TEXT = ("আ", b"\xe2", b"\x82", b"\xac", b"\xe0", "ম")  # a piece's text, or the byte of a byte piece
LOGIT = 10.0  # output weight along a token's axis: its successor's logit is LOGIT * sqrt(d_model) = 80, others 0
PROMPT = "hello"  # ASCII: none of its tokens is in the cycle, so the reply starts at আ
# 8 tokens: আ E2 82 AC E0 ম আ E2 -> "আ€মআ"; E0 is invalid (E0 follows it), the final E2 never completes
MAX_TOKENS = 8
EXPECTED_TEXT, EXPECTED_PIECES, EXPECTED_INVALID = "আ€মআ", ["আ", "€", "ম", "আ"], 2


def cycle_ids(tok: Tokenizer) -> list[int]:
    ids = []
    for t in CYCLE_TEXT:
        if isinstance(t, bytes):
            i = tok.sp.piece_to_id(f"<0x{t[0]:02X}>")
            assert tok.id_to_piece(i) == f"<0x{t[0]:02X}>", "the tokenizer has no byte-fallback piece"
        else:
            enc = tok.encode(t)
            assert len(enc) == 1, f"{t!r} is not one piece of the test tokenizer"
            i = enc[0]
        ids.append(i)
    return ids


@pytest.fixture(scope="module")
def forced_run(bn_data, tmp_path_factory):
    """A checkpoint with the suite's tokenizer (prepared from training/assets) whose greedy output is the
    cycle, and the cycle's ids. No training: it is built in a second."""
    tok = Tokenizer.load(bn_data / layout.TOKENIZER)
    cycle = cycle_ids(tok)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                      max_seq_len=256, tie_embeddings=False)
    w = {k: torch.zeros_like(v) for k, v in Transformer(cfg).state_dict().items()}  # attention, FFN out: zero
    for k in w:
        if k.endswith("norm.weight"):
            w[k].fill_(1.0)
    w["tok_embeddings.weight"][:, 0] = 1.0  # every other token: axis 0, whose successor is the cycle's start
    for axis, i in enumerate(cycle, start=1):
        w["tok_embeddings.weight"][i] = 0.0
        w["tok_embeddings.weight"][i, axis] = 1.0
    w["output.weight"][cycle[0], 0] = LOGIT
    for axis in range(1, len(cycle) + 1):  # the successor of the token on `axis`
        w["output.weight"][cycle[axis % len(cycle)], axis] = LOGIT
    run = tmp_path_factory.mktemp("forced") / "run"
    checkpoint.save(run, 1, weights=w, cfg=cfg, tokenizer=tok)
    return run, cycle


def greedy() -> SamplingParams:
    return SamplingParams.greedy(MAX_TOKENS)


def check_stream(backend, cycle: list[int]) -> None:
    ids = list(backend.generate(backend.tokenize(PROMPT), greedy()))
    assert ids == (cycle * 2)[:MAX_TOKENS]  # the forced tokens, so the text below is what they spell
    stream = completion_stream(backend, PROMPT, greedy())
    pieces = list(stream)
    assert pieces == EXPECTED_PIECES  # "€" arrives whole, after its third byte: nothing partial was shown
    assert stream.text == EXPECTED_TEXT and not any(REPLACEMENT in p for p in pieces)
    assert stream.stats.invalid_bytes == EXPECTED_INVALID
    assert text_decoder(backend)(ids) == EXPECTED_TEXT


def test_the_forced_bytes_are_not_utf8(forced_run):
    """The premise: a plain decode of these tokens writes U+FFFD (what issue 31 saw in the chat)."""
    run, cycle = forced_run
    tok = checkpoint.load(run).tokenizer
    plain = tok.decode((cycle * 2)[:MAX_TOKENS])
    assert plain.count(REPLACEMENT) == EXPECTED_INVALID
    wf = wellformed(plain)  # the metric counts them apart from the clusters
    assert wf.invalid_bytes == EXPECTED_INVALID and wf.to_dict()["invalid_bytes"] == EXPECTED_INVALID
    assert wf.share == 1.0  # আ ম আ: the clusters themselves are fine


def test_decode_utf8_holds_incomplete_and_drops_invalid():
    assert decode_utf8("আ".encode()[:2], final=False) == Utf8Text("", (), b"\xe0\xa6")
    u = decode_utf8(b"a\xe0b\xe2\x82", final=False)
    assert (u.text, u.invalid, u.pending) == ("ab", (b"\xe0",), b"\xe2\x82")
    u = decode_utf8(b"a\xe0b\xe2\x82", final=True)
    assert (u.text, u.invalid, u.pending) == ("ab", (b"\xe0", b"\xe2\x82"), b"")
    assert decode_utf8(b"\x80\xff\xed\xa0\x80x").text == "x"  # stray continuation, 0xFF, a surrogate


def test_torch_stream_never_shows_replacement(forced_run):
    run, cycle = forced_run
    backend = load(run, backend="torch", threads=1)
    try:
        check_stream(backend, cycle)
    finally:
        backend.close()


def test_llamacpp_stream_never_shows_replacement(forced_run, tmp_path):
    from fixtures_serve import try_export_gguf

    run, cycle = forced_run
    backend = load(try_export_gguf(run), threads=1)
    try:
        assert backend.name == "llama.cpp-F16"
        check_stream(backend, cycle)
    finally:
        backend.close()


def test_http_stream_never_shows_replacement(forced_run):
    run, _ = forced_run
    backend = load(run, backend="torch", threads=1)
    try:
        client = TestClient(create_app(backend, ServerConfig(model_id="forced")))
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        pieces = [e["choices"][0]["text"] for e in events[:-1]]
        assert pieces == EXPECTED_PIECES
        assert events[-1]["prodip"]["invalid_bytes"] == EXPECTED_INVALID
        body["stream"] = False
        out = client.post("/v1/completions", json=body).json()
        assert out["choices"][0]["text"] == EXPECTED_TEXT and out["prodip"]["invalid_bytes"] == EXPECTED_INVALID
    finally:
        backend.close()


def test_cli_prints_no_replacement(forced_run):
    run, _ = forced_run
    p = preloaded.run([sys.executable, "-m", "serving", str(run), "--prompt", PROMPT, "--raw", "--temperature", "0",
                        "--max-tokens", str(MAX_TOKENS), "--stats", "--threads", "1"],
                       capture_output=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert p.stdout.decode("utf-8") == EXPECTED_TEXT + "\n"  # strict decode: the output is valid UTF-8
    assert f"{EXPECTED_INVALID} invalid byte sequences dropped" in p.stderr.decode()

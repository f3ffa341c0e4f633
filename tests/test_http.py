"""The OpenAI-compatible server: httpx against a real uvicorn on 127.0.0.1 (a free port).

The server's own GenerationProbe (app.state.generations, counted by its generation scheduler) is what the
one-at-a-time and stop-on-disconnect tests read: no mock, the real app's record of its generations.
(Load, the bounded queue and hang-ups: tests/test_http_load.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import preloaded
import pytest
import uvicorn
from conftest import REPO
from fixtures_serve import (
    BN_QUESTION,
    RAW_PROMPT,
)

from serving import load
from serving.server.http_app import DEFAULT_HOST, ServerConfig, create_app, parse_bind
from serving.text_stream import GenerationProbe
from training.text.normalization import script_counts

MAX_TOKENS_CAP = 192  # room for a long stream (context 256) that a hang-up must cut short
MAX_BODY = 16 * 1024
STARTUP_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, timeout: float = STARTUP_S) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError(f"server at {url} did not come up in {timeout}s")


@pytest.fixture(scope="module")
def live(serve_run):  # noqa: F811
    """(url, the app's GenerationProbe) of a real server in this process."""
    backend = load(serve_run, threads=1)
    app = create_app(backend, ServerConfig(model_id="prodip-test", max_body_bytes=MAX_BODY,
                                           max_tokens_cap=MAX_TOKENS_CAP))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    wait_up(url)
    yield SimpleNamespace(url=url, probe=app.state.generations)
    srv.should_exit = True
    th.join(10)
    backend.close()


@pytest.fixture(scope="module")
def server(live) -> str:
    return live.url


def wait_idle(probe: GenerationProbe, finished: int, timeout: float = 30.0) -> None:
    """Until `finished` generations have ended and none is running or waiting."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        snap = probe.snapshot()
        if snap["finished"] >= finished and snap["active"] == 0 and snap["waiting"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"generations did not end in {timeout}s: {probe.snapshot()}")


def post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(url + path, timeout=60, **kw)


def sse_events(url: str, path: str, body: dict) -> list[dict | str]:
    events: list[dict | str] = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def bn(text: str) -> int:
    return script_counts(text).get("bn", 0)


def chat_body(**kw) -> dict:
    return {"model": "prodip-test", "messages": [{"role": "user", "content": BN_QUESTION}], "max_tokens": 32,
            "temperature": 0.8, "seed": 5, **kw}


def test_health_and_models(server):
    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok" and h["backend"] == "torch" and h["n_ctx"] == 256
    m = httpx.get(server + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "prodip-test"


def test_chat_completion_plain_and_streamed_agree(server):
    r = post(server, "/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == "prodip-test"
    choice = out["choices"][0]
    text = choice["message"]["content"]
    assert choice["message"]["role"] == "assistant" and bn(text) > 0, text
    assert choice["finish_reason"] in ("stop", "length")
    u = out["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and 0 < u["completion_tokens"] <= 32

    events = sse_events(server, "/v1/chat/completions", chat_body(stream=True))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert sum(1 for p in pieces if p) >= 2, f"not streamed in pieces: {pieces}"
    assert "".join(pieces) == text  # same seed, same reply
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] == u["completion_tokens"]


def test_completions_plain_and_streamed(server):
    body = {"prompt": "আমার সোনার বাংলা", "max_tokens": 16, "temperature": 0.8, "seed": 1, "top_k": 20,
            "repeat_penalty": 1.2}
    r = post(server, "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] > 0
    events = sse_events(server, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))
    assert streamed == out["choices"][0]["text"]


def test_stop_string(server):
    text = post(server, "/v1/completions", json={"prompt": "আমার সোনার বাংলা", "max_tokens": 32, "temperature": 0.9,
                                                "seed": 11}).json()["choices"][0]["text"]
    if len(text) < 4:
        pytest.skip(f"continuation too short to cut: {text!r}")
    stop = text[2:4]
    cut = post(server, "/v1/completions", json={"prompt": "আমার সোনার বাংলা", "max_tokens": 32, "temperature": 0.9,
                                               "seed": 11, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == text[:text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def one_line_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert "\n" not in msg and needle in msg, msg


@pytest.mark.parametrize("field,value,needle", [
    ("temperature", -0.5, "temperature"), ("top_p", 0, "top_p"), ("top_p", 1.5, "top_p"), ("top_k", -1, "top_k"),
    ("top_k", 2.5, "top_k"), ("max_tokens", 0, "max_tokens"), ("max_tokens", MAX_TOKENS_CAP + 1, "max_tokens"),
    ("repetition_penalty", 0, "repetition_penalty"), ("seed", "x", "seed"), ("stream", "yes", "stream"),
    ("n", 2, "n=1"), ("stop", [1], "stop"), ("temperature", True, "temperature"),
])
def test_invalid_sampling_parameters_are_400(server, field, value, needle):
    one_line_error(post(server, "/v1/chat/completions", json=chat_body(**{field: value})), 400, needle)


def test_bad_bodies(server):
    raw = json.dumps(chat_body(), ensure_ascii=False).encode().replace("ডিমের".encode(), b"\xff\xfe")
    one_line_error(post(server, "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}),
                   400, "UTF-8")
    one_line_error(post(server, "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
                   400, "JSON")
    one_line_error(post(server, "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                        headers={"content-type": "application/json"}), 400, "lone surrogate")
    one_line_error(post(server, "/v1/chat/completions", json=[1, 2]), 400, "object")
    one_line_error(post(server, "/v1/chat/completions", json={"messages": []}), 400, "messages")
    one_line_error(post(server, "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}),
                   400, "role")
    one_line_error(post(server, "/v1/completions", json={"prompt": 5}), 400, "prompt")
    big = {"messages": [{"role": "user", "content": "ক" * MAX_BODY}]}
    one_line_error(post(server, "/v1/chat/completions", json=big), 413, "limit")


def test_prompt_longer_than_context_is_400(server):
    long = "বাংলা ভাষা " * 300  # well under the body cap, far over 256 tokens
    one_line_error(post(server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}),
                   400, "context")
    one_line_error(post(server, "/v1/completions", json={"prompt": long}), 400, "context")


def test_long_conversation_drops_oldest_turns_and_says_so(server):
    turn = "আমি আজ সকালে বাজারে গিয়েছিলাম এবং অনেক সবজি কিনেছি। " * 3
    msgs = []
    for _ in range(10):
        msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": turn}]
    msgs.append({"role": "user", "content": BN_QUESTION})
    r = post(server, "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert int(r.headers["x-prodip-dropped-messages"]) > 0
    assert r.json()["prodip"]["dropped_messages"] > 0 and "dropped" in r.json()["prodip"]["notice"]


def test_concurrent_requests_are_served_one_at_a_time(live):
    """Three requests at once: all answered, they did wait for each other (so the test means
    something), and no two generations ever ran at the same moment."""
    probe = live.probe
    first = probe.snapshot()["finished"]
    results: list[int] = []

    def one(seed: int) -> None:  # long generations (near-uniform sampling), so the three overlap in time
        body = {"prompt": RAW_PROMPT, "max_tokens": 64, "temperature": 3.0, "top_k": 0, "seed": seed,
                "stream": bool(seed % 2)}
        results.append(post(live.url, "/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200, 200, 200]
    wait_idle(probe, first + 3)
    assert probe.peak_active == 1, probe.snapshot()  # over every request this server has answered
    assert probe.finished == first + 3
    runs = sorted(list(probe.recent)[-3:], key=lambda st: st.started_at)
    assert all(a.ended_at <= b.started_at for a, b in zip(runs, runs[1:])), "two generations overlapped"
    assert any(st.queued_at < prev.ended_at for prev, st in zip(runs, runs[1:])), \
        "the requests never waited for each other: nothing was tested"


def test_parse_bind_defaults_to_loopback():
    assert parse_bind("8000") == (DEFAULT_HOST, 8000) == ("127.0.0.1", 8000)
    assert parse_bind("0.0.0.0:9") == ("0.0.0.0", 9)
    with pytest.raises(ValueError, match="PORT"):
        parse_bind("localhost:http")


def test_cli_http_serves(serve_run):  # noqa: F811
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "serving", str(serve_run), "--http", str(port), "--threads", "1"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url)
        r = post(url, "/v1/chat/completions", json=chat_body(max_tokens=8))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert f"on http://127.0.0.1:{port}/v1" in err


def long_request(url: str) -> dict:
    """A seeded completion request that, left alone, generates all MAX_TOKENS_CAP tokens (checked)."""
    for seed in range(10):
        body = {"prompt": RAW_PROMPT, "max_tokens": MAX_TOKENS_CAP, "temperature": 3.0, "top_k": 0, "top_p": 1.0,
                "repetition_penalty": 1.0, "seed": seed}
        if post(url, "/v1/completions", json=body).json()["usage"]["completion_tokens"] == MAX_TOKENS_CAP:
            return body
    raise AssertionError(f"no seed in 0..9 gives a {MAX_TOKENS_CAP}-token completion")


def test_client_disconnect_mid_stream_stops_generation(live):
    """A client that hangs up after the first streamed piece: the server's generation loop ends soon
    after (cancelled, far short of max_tokens), and the model is free for the next request."""
    probe = live.probe
    body = long_request(live.url)
    wait_idle(probe, probe.snapshot()["finished"])
    first = probe.snapshot()["finished"]
    with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))  # the first piece, then hang up
    wait_idle(probe, first + 1)
    assert probe.finished == first + 1
    st = probe.recent[-1]
    assert st.finish_reason == "cancelled", (st.finish_reason, st.completion_tokens)
    assert st.completion_tokens < MAX_TOKENS_CAP // 2, st.completion_tokens
    r = post(live.url, "/v1/chat/completions", json=chat_body(max_tokens=4))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("flag", [["--raw"], ["--chat"], ["--temperature", "0"], ["--max-tokens", "8"],
                                  ["--seed", "1"], ["--stop", "x"], ["--system", "x"], ["--stats"]])
def test_cli_http_refuses_terminal_flags_by_name(serve_run, flag):  # noqa: F811
    """--http serves requests that carry their own settings: a flag it would drop is refused, by name,
    before the port is taken or the model loads (issue 28)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = preloaded.run([sys.executable, "-m", "serving", str(serve_run), "--http", "0", *flag], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith(f"error: {flag[0]} does not apply to --http"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "serving on" not in p.stderr


# --------------------------------------------------------------------- issue 42: field types, --system
LABELS_OK = {"model": "any-name", "user": "u-1", "metadata": {"k": "v"}, "store": False}


@pytest.mark.parametrize("extra,needle", [
    ({"model": 5}, "model"), ({"model": ["prodip"]}, "model"), ({"model": "m" * 600}, "model"),
    ({"user": {"id": 1}}, "user"), ({"user": True}, "user"), ({"user": "\ud800"}, "user"),
    ({"stream_options": "yes", "stream": True}, "stream_options"),
    ({"stream_options": [True], "stream": True}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}, "stream": True}, "include_usage"),
    ({"stream_options": {"include_usag": True}, "stream": True}, "'include_usag'"),
    ({"stream_options": {"include_usage": True}}, "stream: true"),
    ({"metadata": "x"}, "metadata"), ({"metadata": {"k": 1}}, "metadata"), ({"metadata": [["k", "v"]]}, "metadata"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "16"), ({"metadata": {"k" * 65: "v"}}, "64"),
    ({"store": "no"}, "store"), ({"store": 0}, "store"),
])
def test_label_fields_are_type_checked(client, extra, needle):
    """Fields that change no output still have OpenAI's types: any other is a one-line 400 (a87fbb0: 200)."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "ক"}]}),
                       ("/v1/completions", {"prompt": "ক"})):
        raw = json.dumps({**body, "max_tokens": 2, **extra}).encode()  # ASCII: a lone surrogate as "\\ud800"
        one_line_error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400, needle)


def test_label_fields_of_the_right_types_are_accepted(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ক"}], "max_tokens": 2,
                                                  **LABELS_OK, "model": None})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"prompt": "ক", "max_tokens": 2, "stream": True, **LABELS_OK,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


@pytest.mark.parametrize("message,needle", [
    ({"role": "user", "content": "ক", "name": "bob"}, "messages[0]: unknown field 'name'"),
    ({"role": "user", "content": "ক", "contnet": "x"}, "unknown field 'contnet'"),
    ({"role": "user", "content": [{"type": "text", "text": "ক", "cache_control": {}}]}, "'cache_control'"),
    ({"role": 5, "content": "ক"}, "role"), ({"role": ["user"], "content": "ক"}, "role"),
])
def test_unknown_keys_inside_a_message_are_refused(client, message, needle):
    """Like an unknown top-level field: refused by name, never dropped (a87fbb0 dropped them: 200)."""
    one_line_error(client.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 2}), 400, needle)


@pytest.mark.parametrize("flags", [["--raw"], []])
def test_system_prompt_is_never_dropped_by_a_completion(tiny_run, capsys, flags):
    """A base model completes text, and --raw completes with any model: neither has a system prompt, so
    --system is refused by name, one line, before anything is generated (a87fbb0: dropped silently)."""
    from serving.__main__ import main

    rc = main([str(tiny_run), "--prompt", "আমার সোনার বাংলা", "--system", "উত্তর দাও", "--max-tokens", "2", *flags])
    captured = capsys.readouterr()
    assert rc != 0 and captured.out == "", captured
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --system"), err
    assert ("--raw" if flags else "--chat") in err[0], err

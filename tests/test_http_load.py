"""The HTTP server under load and hang-ups (issue 42, items 2 and 9): a real uvicorn on 127.0.0.1 whose
request worker pool is smaller than the number of concurrent streaming clients.

The promise: every client is answered (a complete 200 stream) or refused with 503 + Retry-After,
none hangs, the server answers normally afterwards; a request waits a bounded time for its turn, a
full queue is refused at once, a client that hangs up frees its place or stops its generation, and a
client that hangs up mid-body is one log line. Deterministic cases use a backend that generates only
as its test lets it (a gate), so "the model is busy" is a state, not a race; the load case uses the
suite's chat GGUF (llama.cpp)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import anyio.to_thread
import httpx
import pytest
import uvicorn
from fixtures_serve import BN_QUESTION

from serving import load
from serving.server.http_app import ServerConfig, create_app

WORKER_THREADS = 4  # the request worker pool of the load test's server (anyio's default is 40)
CLIENTS = 2 * WORKER_THREADS
CLIENT_TIMEOUT_S = 20  # a client still waiting after this has hung: the test fails instead of hanging
SETTLE_S = 10.0  # the longest a deterministic test waits for the server to reach a state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(cond, what: str, timeout: float = SETTLE_S) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not reached in {timeout}s: {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def running(app, threads: int | None = None) -> Iterator[str]:
    """A real uvicorn serving `app` on 127.0.0.1 in this process; `threads`: its request worker pool
    (anyio's thread limiter, which runs the handlers' blocking calls), set before the first request."""
    async def sized(scope, receive, send):
        if threads is not None:
            anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        await app(scope, receive, send)

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(sized, host="127.0.0.1", port=port, log_level="info", access_log=False,
                                        timeout_graceful_shutdown=2))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    until(lambda: srv.started, "the server started", 30)
    try:
        yield url
    finally:
        srv.should_exit = True
        th.join(15)


class GatedBackend:
    """A model that emits one token ("x") each time its test opens the gate: while the gate is shut the
    generation is running and the model busy, as long as the test wants."""

    name, n_ctx, eos_ids, prodip = "gated", 512, (0,), True

    def __init__(self) -> None:
        self.gate = threading.Semaphore(0)

    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]:
        special = {"<|im_start|>": [2], "<|im_end|>": [3]}
        if allow_special and text in special:
            return special[text]
        return ([1] if bos else []) + [10 + ord(c) % 50 for c in text]

    def detokenize(self, ids) -> str:
        return "x" * len(ids)

    def generate(self, ids, params):
        for _ in range(params.max_new_tokens):
            if not self.gate.acquire(timeout=SETTLE_S):  # bounded: a broken test ends, it does not hang
                return
            yield 65

    def release(self, n: int = 1000) -> None:
        for _ in range(n):
            self.gate.release()

    def close(self) -> None:
        pass


@pytest.fixture
def gated():
    """(url, backend, probe) of a server over a GatedBackend: 2 may wait, each at most 1 s."""
    backend = GatedBackend()
    app = create_app(backend, ServerConfig(model_id="gated", max_waiting=2, wait_s=1.0))
    with running(app) as url:
        yield SimpleNamespace(url=url, backend=backend, probe=app.state.generations)
        backend.release()  # whatever a test left waiting ends before the server stops


def completion(url: str, results: list, stream: bool = False, tokens: int = 3) -> threading.Thread:
    def go() -> None:
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": tokens, "stream": stream},
                           timeout=CLIENT_TIMEOUT_S)
            results.append(r)
        except httpx.HTTPError as e:
            results.append(e)
    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


def is_busy(r) -> bool:
    """A 503 in OpenAI's error shape, one line, with a Retry-After of whole seconds."""
    if not isinstance(r, httpx.Response) or r.status_code != 503:
        return False
    msg = r.json()["error"]["message"]
    return "busy" in msg and "\n" not in msg and r.headers.get("retry-after", "").isdigit() \
        and int(r.headers["retry-after"]) >= 1


def test_a_full_queue_is_refused_at_once_and_the_others_are_served(gated):
    probe, results = gated.probe, []
    running_one = [completion(gated.url, results, stream=True)]
    until(lambda: probe.active == 1, "the first request generating")
    waiting = [completion(gated.url, results) for _ in range(2)]
    until(lambda: probe.waiting == 2, "two requests waiting")
    refused: list = []
    completion(gated.url, refused).join(5)  # the queue is full: answered at once, not after a wait
    assert len(refused) == 1 and is_busy(refused[0]), refused
    assert probe.snapshot()["refused"] == 1
    gated.backend.release()
    for th in running_one + waiting:
        th.join(CLIENT_TIMEOUT_S)
    assert [r.status_code for r in results] == [200, 200, 200], results
    for r in results:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == 3, r.text
    assert probe.peak_active == 1 and probe.peak_waiting == 2, probe.snapshot()
    assert httpx.get(gated.url + "/health").json()["generations"]["waiting"] == 0


def test_a_request_waits_a_bounded_time_for_its_turn(gated):
    probe, first, second = gated.probe, [], []
    completion(gated.url, first)
    until(lambda: probe.active == 1, "the first request generating")
    t0 = time.monotonic()
    completion(gated.url, second).join(CLIENT_TIMEOUT_S)
    waited = time.monotonic() - t0
    assert len(second) == 1 and is_busy(second[0]), second
    assert "within 1 s" in second[0].json()["error"]["message"] and waited >= 1.0, waited
    assert probe.waiting == 0  # its place is free again
    gated.backend.release()
    until(lambda: len(first) == 1, "the first request answered")
    assert first[0].status_code == 200


def test_a_client_that_hangs_up_while_waiting_frees_its_place(gated):
    probe, results = gated.probe, []
    completion(gated.url, results)
    until(lambda: probe.active == 1, "the first request generating")
    with pytest.raises(httpx.ReadTimeout):  # waits for its turn, then its client gives up
        httpx.post(gated.url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=0.3)
    until(lambda: probe.waiting == 0, "the abandoned request left the queue")
    later: list = []
    completion(gated.url, later)
    until(lambda: probe.waiting == 1, "a new request waiting")
    gated.backend.release()
    until(lambda: len(results) == len(later) == 1, "both answered")
    assert results[0].status_code == later[0].status_code == 200
    assert probe.finished == 2, probe.snapshot()  # the abandoned one never ran


@pytest.fixture
def server_log() -> Iterator[list[logging.LogRecord]]:
    """The records the server logs meanwhile (uvicorn.error's reach the "uvicorn" logger too)."""
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(handler)
    try:
        yield lines
    finally:
        uvicorn_log.removeHandler(handler)


def one_line_logged(lines: list[logging.LogRecord], needle: str) -> None:
    said = [r.getMessage() for r in lines]
    assert not [r for r in lines if r.exc_info or r.levelno >= logging.ERROR], said  # no traceback
    assert len(said) == 1 and "\n" not in said[0] and needle in said[0], said


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_mid_reply_stops_its_generation(gated, server_log, stream):
    probe = gated.probe
    gated.backend.release(2)  # two tokens, then the model waits: the client gives up and hangs up
    with contextlib.suppress(httpx.ReadTimeout), httpx.stream(
            "POST", gated.url + "/v1/completions", json={"prompt": "a", "max_tokens": 100, "stream": stream},
            timeout=0.5) as r:
        for _ in r.iter_lines():
            pass
    for _ in range(100):  # the model may go on, one token at a time: the hang-up ends it within a few
        if probe.finished:
            break
        gated.backend.release(1)
        time.sleep(0.05)
    st = probe.recent[-1]
    assert st.finish_reason == "cancelled" and st.completion_tokens < 50, st
    until(lambda: server_log, "the hang-up logged")
    time.sleep(0.3)  # anything else it would log
    one_line_logged(server_log, "disconnected")


def test_a_client_that_hangs_up_mid_body_is_one_log_line(gated, server_log):
    port = int(gated.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": [")
        time.sleep(0.2)
    until(lambda: server_log, "a log line")
    time.sleep(0.3)  # anything else it would log
    one_line_logged(server_log, "while sending the request body")
    assert httpx.get(gated.url + "/health").json()["status"] == "ok"


class SlowModel:
    """A loaded backend whose every token takes at least TOKEN_S longer: generations that overlap in
    time on any machine, so the clients really do wait for each other."""

    TOKEN_S = 0.01

    def __init__(self, backend) -> None:
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def generate(self, ids, params):
        for t in self._backend.generate(ids, params):
            time.sleep(self.TOKEN_S)
            yield t


def stream_client(url: str, seed: int, start: threading.Barrier, out: dict) -> None:
    body = {"messages": [{"role": "user", "content": BN_QUESTION}], "max_tokens": 16, "temperature": 0.8,
            "seed": seed, "stream": True}
    start.wait()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S) as r:
            lines = [x for x in r.iter_lines() if x]
            out[seed] = (r.status_code, lines, r.headers.get("retry-after"))
    except httpx.HTTPError as e:
        out[seed] = ("hung", repr(e), None)


def test_more_streaming_clients_than_worker_threads(serve_gguf, capsys):
    """2x the server's worker threads of concurrent streaming chats: each gets a complete stream or a
    503 with Retry-After, none hangs; then a normal request and /health are answered. (a87fbb0: the
    stream holding the generation lock waited for a worker thread that every waiting stream held.)"""
    backend = load(serve_gguf, threads=1)
    app = create_app(SlowModel(backend), ServerConfig(model_id="load", max_waiting=CLIENTS - 3, wait_s=15))
    out: dict = {}
    try:
        with running(app, threads=WORKER_THREADS) as url:
            start = threading.Barrier(CLIENTS)
            t0 = time.monotonic()
            clients = [threading.Thread(target=stream_client, args=(url, i, start, out), daemon=True)
                       for i in range(CLIENTS)]
            for th in clients:
                th.start()
            for th in clients:
                th.join(CLIENT_TIMEOUT_S + 5)
            took = time.monotonic() - t0
            try:
                after = httpx.post(url + "/v1/chat/completions", timeout=CLIENT_TIMEOUT_S,
                                   json={"messages": [{"role": "user", "content": BN_QUESTION}], "max_tokens": 8})
                health = httpx.get(url + "/health", timeout=5).json()
            except httpx.HTTPError as e:
                after, health = e, {}
    finally:  # bounded: a server that deadlocked holds the model's lock, and close() would wait forever
        closer = threading.Thread(target=backend.close, daemon=True)
        closer.start()
        closer.join(CLIENT_TIMEOUT_S)
    assert all(code != "hung" for code, _, _ in out.values()), out
    assert isinstance(after, httpx.Response), f"the server no longer answers: {after!r}"
    answered = [s for s, (code, lines, _) in out.items() if code == 200 and lines[-1] == "data: [DONE]"
                and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")]
    refused = [s for s, (code, _, retry) in out.items() if code == 503 and retry is not None and retry.isdigit()]
    assert len(out) == CLIENTS and sorted(answered + refused) == list(range(CLIENTS)), out
    assert len(answered) >= CLIENTS - 3  # the queue holds all but 2: at most 2 arrive to a full one
    probe = app.state.generations
    assert probe.peak_active == 1 and probe.peak_waiting + len(refused) > WORKER_THREADS, probe.snapshot()
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["role"] == "assistant", after.text
    assert health["status"] == "ok" and health["generations"]["waiting"] == health["generations"]["active"] == 0
    with capsys.disabled():
        print(f"\n[http load] {CLIENTS} streaming clients, {WORKER_THREADS} worker threads: {len(answered)} answered, "
              f"{len(refused)} refused (503), {took:.2f}s; peak waiting {probe.peak_waiting}")

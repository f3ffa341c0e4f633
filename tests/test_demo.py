"""The Gradio Bangla chat demo, driven through gradio_client against a real server on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
from conftest import REPO
from fixtures_serve import BN_QUESTION, serve_gguf, serve_run  # noqa: F401  (pytest fixtures)

from demo.app import (
    DEFAULT_HOST,
    DemoError,
    build_app,
    default_model,
    discover_models,
    history_to_messages,
    launch,
)
from demo.models import QUICKSTART_CHAT, QUICKSTART_RUN, quickstart_gguf_dir
from serving import load
from serving.backend import SamplingParams
from training.text import script_counts

LOCK_PROBE_S = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bn(text: str) -> int:
    return script_counts(text).get("bn", 0)


@pytest.fixture(scope="module")
def demo(serve_run, serve_gguf):  # noqa: F811
    entries = discover_models(serve_run)
    app, pool = build_app(entries, threads=1)
    url = launch(app, host=DEFAULT_HOST, port=free_port(), block=False, quiet=True)
    assert url.startswith("http://127.0.0.1:")
    yield url, entries
    app.close()
    pool.close()


def client_for(url: str):
    from gradio_client import Client

    return Client(url, verbose=False, download_files=False)


def ask(url: str, label: str, message: str, history: list | None = None, max_tokens: int = 24, seed: int = 5):
    """Submit one chat message; returns (every streamed update, the final update)."""
    job = client_for(url).submit(message, history or [], label, max_tokens, 0.8, 40, 0.95, 1.1, seed, api_name="/chat")
    final = job.result(timeout=120)
    return job.outputs(), final


def last_reply(update) -> str:
    _, chat, _ = update
    assert chat[-1]["role"] == "assistant"
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in
                   (chat[-1]["content"] if isinstance(chat[-1]["content"], list) else [chat[-1]["content"]]))


def check_streamed_bangla_reply(url: str, label: str) -> None:
    updates, final = ask(url, label, BN_QUESTION)
    box, chat, status = final
    assert box == ""  # the textbox is cleared for the next message
    assert [m["role"] for m in chat] == ["user", "assistant"]
    reply = last_reply(final)
    assert bn(reply) > 0, f"{label}: reply is not Bangla: {reply!r}"
    assert "টোকেন/সেকেন্ড" in status and label in status
    partial = [last_reply(u) for u in updates if u[1]]
    assert len({p for p in partial if p}) >= 2, f"{label}: reply was not streamed: {partial}"
    assert all(reply.startswith(p) for p in partial if p not in ("", "…"))


def test_discovers_checkpoint_and_exports(demo, serve_gguf, serve_run):  # noqa: F811
    _, entries = demo
    kinds = [e.backend for e in entries]
    assert kinds[0] == "torch" and "llama.cpp" in kinds
    # from a file under RUN/export/gguf the run is found (training.layout.run_dir_of): its checkpoint too
    from_gguf = discover_models(serve_gguf)
    assert from_gguf[0].path == serve_gguf
    assert [e.path.resolve() for e in from_gguf if e.backend == "torch"] == [serve_run.resolve()]


def test_torch_reply_is_streamed_bangla(demo):
    url, entries = demo
    check_streamed_bangla_reply(url, entries[0].label)


def test_llamacpp_reply_is_streamed_bangla(demo, serve_gguf):  # noqa: F811
    # A llama.cpp backend must let its tokenizer be used while generate() is suspended mid-stream
    # (the streaming layer decodes every new token); probe that first rather than hang the demo.
    b = load(serve_gguf, threads=1)
    gen = b.generate(b.tokenize("আমি"), SamplingParams(max_new_tokens=2, seed=0))
    first = next(gen, None)
    done = threading.Event()
    if first is not None:
        threading.Thread(target=lambda: (b.detokenize([first]), done.set()), daemon=True).start()
        if not done.wait(LOCK_PROBE_S):
            pytest.fail("LlamaCppBackend.detokenize blocks while a generate() stream is open "
                        "(it takes the lock generate holds); serving/llamacpp.py must not lock detokenize")
    gen.close()
    b.close()
    url, entries = demo
    label = next(e.label for e in entries if e.backend == "llama.cpp")
    check_streamed_bangla_reply(url, label)


def test_conversation_history_is_used(demo):
    url, entries = demo
    _, first = ask(url, entries[0].label, BN_QUESTION, max_tokens=8)
    history = first[1]
    assert history_to_messages(history)[0] == {"role": "user", "content": BN_QUESTION}
    _, second = ask(url, entries[0].label, "আর চিনি?", history=history, max_tokens=8)
    assert [m["role"] for m in second[1]] == ["user", "assistant", "user", "assistant"]


def test_over_long_prompt_is_a_clear_message(demo):
    from gradio_client.exceptions import AppError

    url, entries = demo
    with pytest.raises(AppError, match="প্রসঙ্গসীমার"):
        ask(url, entries[0].label, "বাংলা ভাষা " * 300)
    with pytest.raises(AppError, match="খুব লম্বা"):
        ask(url, entries[0].label, "ক" * 5000)


def test_dropped_turns_are_announced(demo):
    url, entries = demo
    turn = "আমি আজ সকালে বাজারে গিয়েছিলাম এবং অনেক সবজি কিনেছি। " * 3
    history = []
    for _ in range(8):
        part = [{"type": "text", "text": turn}]  # Gradio 6's message format
        history += [{"role": "user", "content": part}, {"role": "assistant", "content": part}]
    _, final = ask(url, entries[0].label, BN_QUESTION, history=history, max_tokens=8)
    assert "বাদ দেওয়া হয়েছে" in final[2]


def test_missing_model_and_default_lookup(tmp_path, serve_run, monkeypatch):  # noqa: F811
    with pytest.raises(DemoError, match="model not found"):
        discover_models(tmp_path / "nope.gguf")
    monkeypatch.delenv("PRODIP_HOME", raising=False)
    with pytest.raises(DemoError, match="quickstart"):
        default_model(tmp_path)
    # the quickstart run's checkpoint, then its Q4_K_M GGUF (preferred), also through $PRODIP_HOME
    home = tmp_path / "home"
    qs = home / QUICKSTART_RUN / QUICKSTART_CHAT  # demo.quickstart's chat-tuned run
    qs.parent.mkdir(parents=True)
    os.symlink(serve_run, qs)
    monkeypatch.setenv("PRODIP_HOME", str(home))
    assert default_model(tmp_path).resolve() == serve_run.resolve()
    gguf_dir = quickstart_gguf_dir(home / QUICKSTART_RUN)
    assert gguf_dir == qs / "export" / "gguf"  # the path docs/serving.md and the README give
    gguf_dir.mkdir(parents=True, exist_ok=True)
    (gguf_dir / "chat-Q4_K_M.gguf").write_bytes(b"")
    try:
        assert default_model(tmp_path) == gguf_dir / "chat-Q4_K_M.gguf"
    finally:
        (gguf_dir / "chat-Q4_K_M.gguf").unlink()


def test_cli_without_a_model_says_run_the_quickstart(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PRODIP_HOME"}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([sys.executable, "-m", "demo"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and "quickstart" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_defaults_are_private():
    from demo.__main__ import build_parser

    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.share is False

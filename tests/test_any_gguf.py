"""Any GGUF llama.cpp can run, not only prodip's: real Qwen2 and Gemma files written by llama.cpp's own
convert_hf_to_gguf.py (tests/fixtures_foreign_gguf.py), served through their own chat templates.

- `serving.load` opens them as foreign (`prodip` False) and `describe()` says what they are;
- a chat renders through the file's template (ChatML markers for Qwen2, <start_of_turn> for Gemma),
  its markers tokenized as single special tokens, and the model answers with tokens;
- a file without a template falls back to plain completion and says so (a `warning:` line at load,
  `chat_notice`, the chat's notice); its long trained context is capped, not allocated;
- a GGUF llama.cpp cannot load is one error naming the file, leaks nothing, and a model already
  loaded keeps serving;
- `python -m serving FOREIGN.gguf --http` answers an OpenAI-style chat request.
"""

from __future__ import annotations

import os
import queue
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import preloaded
import pytest
from conftest import REPO, stop
from fixtures_foreign_gguf import (
    CONTEXT,
    GEMMA,
    LONG_CONTEXT,
    without_tensor,
)

import serving
from serving.backend import SamplingParams, ServingError
from serving.backends.llamacpp_backend import FOREIGN_MAX_CTX
from serving.chat_session import chat_stream, plain_text
from training.text.chat_template import CHAT_TEMPLATE

MESSAGES = [{"role": "system", "content": "তুমি সাহায্যকারী।"}, {"role": "user", "content": "হ্যালো, কেমন আছ?"}]
NEW_TOKENS = 8
FAILED_LOADS = 5  # repeated refusals must not pile up threads, descriptors or mappings
SERVER_START_S = 120
ANNOUNCE = re.compile(r"serving .* on (http://127\.0\.0\.1:[1-9][0-9]*/v1)")


@pytest.fixture(scope="module")
def qwen2(foreign_ggufs):  # noqa: F811
    with serving.load(foreign_ggufs.qwen2, threads=1) as b:
        yield b


def _reply(backend, messages=MESSAGES):
    prepared, stream = chat_stream(backend, messages, SamplingParams.greedy(NEW_TOKENS))
    text = "".join(stream)
    return prepared, stream, text


@pytest.mark.parametrize("kind,arch", [("qwen2", "qwen2"), ("gemma", "gemma")])
def test_foreign_file_loads_and_describes_itself(foreign_ggufs, kind, arch):  # noqa: F811
    path = getattr(foreign_ggufs, kind)
    with serving.load(path, threads=1) as b:
        d = b.describe()
        assert b.prodip is False and b.chat_template is not None and b.chat_template != CHAT_TEMPLATE
        assert d["arch"] == arch and d["kind"] == "foreign" and d["prodip"] is False
        assert d["chat_template"] is True and d["quant"] == "F32" and d["context"] == CONTEXT
        assert d["n_params"] > 0 and d["file"] == path.name and serving.describe(b) == d
        assert b.eos_ids, "a foreign file's end-of-generation tokens come from the file"


def test_qwen2_chat_renders_chatml_from_the_file(qwen2):
    prompt, stop = qwen2.render_chat(MESSAGES)
    want = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES) + "<|im_start|>assistant\n"
    assert prompt == want and stop == ("<|im_end|>",)
    prepared, stream, _ = _reply(qwen2)
    [im_start] = qwen2.tokenize("<|im_start|>", bos=False, allow_special=True)
    [im_end] = qwen2.tokenize("<|im_end|>", bos=False, allow_special=True)
    assert prepared.ids.count(im_start) == len(MESSAGES) + 1 and prepared.ids.count(im_end) == len(MESSAGES)
    assert im_end in qwen2.eos_ids, "<|im_end|> ends the reply"
    assert prepared.notice is None and "<|im_end|>" in stream.params.stop
    assert stream.stats.completion_tokens >= 1 and stream.stats.finish_reason in ("stop", "length")


def test_gemma_chat_uses_its_own_template(foreign_ggufs):  # noqa: F811
    with serving.load(foreign_ggufs.gemma, threads=1) as b:
        assert b.chat_template == GEMMA
        prompt, _ = b.render_chat(MESSAGES)
        assert prompt.startswith("<s><start_of_turn>system\n") and prompt.endswith("<start_of_turn>model\n")
        assert "<|im_start|>" not in prompt
        prepared, stream, _ = _reply(b)
        [turn] = b.tokenize("<start_of_turn>", bos=False, allow_special=True)
        assert prepared.ids[0] == b.llm.token_bos() and prepared.ids.count(turn) == len(MESSAGES) + 1
        assert stream.stats.completion_tokens >= 1


def test_foreign_history_is_trimmed_to_the_context(qwen2):
    turn = [{"role": "user", "content": "আমাদের গ্রামের পাশ দিয়ে একটি ছোট নদী বয়ে গেছে। " * 3},
            {"role": "assistant", "content": "হ্যাঁ।"}]
    prepared, _, _ = _reply(qwen2, [MESSAGES[0], *turn * 12, MESSAGES[1]])
    assert prepared.dropped > 0 and "dropped" in prepared.notice
    assert prepared.messages[0] == MESSAGES[0] and prepared.messages[-1]["content"] == MESSAGES[1]["content"]
    assert prepared.messages[1]["role"] == "user", "a trimmed conversation still starts with the user"
    assert len(prepared.ids) <= CONTEXT - NEW_TOKENS


def test_file_without_template_falls_back_to_plain_completion_and_says_so(foreign_ggufs, capfd):  # noqa: F811
    with serving.load(foreign_ggufs.no_template, threads=1) as b:
        err = capfd.readouterr().err
        assert b.chat_template is None and b.render_chat(MESSAGES) is None
        assert b.chat_notice and "no chat template" in b.chat_notice
        assert [x for x in err.splitlines() if "no chat template" in x] == [f"warning: {b.chat_notice}"]
        d = b.describe()
        assert d["chat_template"] is False and d["chat_notice"] == b.chat_notice
        assert d["trained_context"] == LONG_CONTEXT and d["context"] == FOREIGN_MAX_CTX == b.n_ctx
        prepared, stream, _ = _reply(b)
        assert prepared.ids == b.tokenize(plain_text(MESSAGES), bos=True)
        assert prepared.notice.startswith(b.chat_notice) and stream.stats.completion_tokens >= 1


def _resources(path: Path) -> tuple[int, int, int]:
    """(threads, open descriptors, memory mappings of `path`) of this process."""
    maps = Path("/proc/self/maps").read_text().count(str(path))
    return threading.active_count(), len(os.listdir("/proc/self/fd")), maps


def test_unloadable_gguf_is_one_error_naming_the_file_and_leaks_nothing(foreign_ggufs, qwen2, tmp_path):  # noqa: F811
    src = foreign_ggufs.qwen2
    data = src.read_bytes()
    broken = {
        "truncated.gguf": data[: len(data) // 2],
        "garbage.gguf": b"GGUF" + random.Random(0).randbytes(4000),
        "missing-tensor.gguf": None,  # gguf-py reads it; llama.cpp refuses it
    }
    for name, blob in broken.items():
        if blob is None:
            without_tensor(src, tmp_path / name, "blk.1.ffn_down.weight")
        else:
            (tmp_path / name).write_bytes(blob)
    want, _, _ = _reply(qwen2)
    for name in broken:
        path = tmp_path / name
        before = _resources(path)
        for _ in range(FAILED_LOADS):
            with pytest.raises(ServingError) as e:
                serving.load(path, threads=1)
            assert str(path) in str(e.value) and "GGUF" in str(e.value) and "\n" not in str(e.value)
        assert _resources(path) == before, f"{name}: refused loads left threads, descriptors or mappings"
    assert "blk.1.ffn_down.weight" in str(e.value), "llama.cpp's own reason is in the error"
    again, _, _ = _reply(qwen2)
    assert again.ids == want.ids, "the loaded model kept serving"


def test_cli_names_an_unloadable_file(foreign_ggufs, tmp_path):  # noqa: F811
    bad = without_tensor(foreign_ggufs.qwen2, tmp_path / "broken-F32.gguf", "output_norm.weight")
    p = preloaded.run([sys.executable, "-m", "serving", str(bad), "--prompt", "হ্যালো", "--max-tokens", "4"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert lines == [lines[-1]] and lines[-1].startswith(f"error: {bad}: llama.cpp cannot load"), p.stderr


def _announced_url(p: subprocess.Popen, lines: queue.Queue) -> str:
    """The URL `python -m serving --http HOST:0` announces once it has bound a free port."""
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert p.poll() is None, f"the server exited ({p.returncode})"
            continue
        if m := ANNOUNCE.search(line):
            return m.group(1)
    raise AssertionError(f"no 'serving ... on http://...' line in {SERVER_START_S}s")


def test_cli_http_serves_a_foreign_file(foreign_ggufs):  # noqa: F811
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "serving", str(foreign_ggufs.qwen2), "--http", "127.0.0.1:0",
                          "--threads", "1"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in p.stderr], daemon=True)
    reader.start()
    try:
        url = _announced_url(p, lines)
        assert httpx.get(url + "/models", timeout=30).status_code == 200
        r = httpx.post(url + "/chat/completions", timeout=60,
                       json={"messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        stop(p)
        reader.join(10)

"""The Gradio chat demo, in Bangla: streaming replies, a picker among the run's exported models,
sampling controls and tokens/s. Built on `serving` (one Backend per model, loaded on first use).

Safety defaults: binds 127.0.0.1, no public share link unless asked, one generation at a time per
model (llama.cpp contexts are not re-entrant), messages capped in length, clear messages for a
missing model or a prompt longer than the context.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline: no telemetry, no version check

import threading
from collections.abc import Iterator

import gradio as gr

from demo.models import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    QUICKSTART_HINT,
    DemoError,
    ModelEntry,
    default_model,
    discover_models,
)
from serving import Backend, SamplingParams, load
from serving.chat_session import PromptTooLong, chat_stream

__all__ = ["DemoError", "ModelEntry", "build_app", "default_model", "discover_models", "launch"]

TITLE = "প্রদীপ · বাংলা চ্যাট"
DESCRIPTION = (
    "প্রদীপ একটি ছোট বাংলা ভাষার মডেল, এই কম্পিউটারেই চলছে — কোনো তথ্য বাইরে যায় না। "
    "বাংলায় প্রশ্ন লিখুন, উত্তর শব্দে শব্দে আসবে। ডান দিক থেকে মডেল (GGUF, ONNX বা PyTorch) "
    "আর নমুনায়নের সেটিং বদলাতে পারেন।"
)
PLACEHOLDER = "এখানে বাংলায় আপনার বার্তা লিখুন…"
CHAT_PLACEHOLDER = "নমস্কার! আমি প্রদীপ। কিছু জিজ্ঞেস করুন।"
EXAMPLES = [
    "আজকের আবহাওয়া কেমন?",
    "একটি ছোট গল্প বলো।",
    "সকালে হাঁটার উপকারিতা কী?",
    "ভাই, ডিমের হালি কত?",
]
SEND_LABEL, CLEAR_LABEL = "পাঠান", "নতুন কথোপকথন"
MAX_MESSAGE_CHARS = 4000  # far beyond any context we serve; refuses pasted novels before tokenizing
DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT = 128, 1024
QUEUE_MAX_SIZE = 32
class ModelPool:
    """Backends loaded on first use, each with its own lock: one generation at a time per model."""

    def __init__(self, entries: list[ModelEntry], threads: int | None = None):
        self.entries = {e.label: e for e in entries}
        self.threads = threads
        self._backends: dict[str, Backend] = {}
        self._locks = {e.label: threading.Lock() for e in entries}
        self._load_lock = threading.Lock()

    def get(self, label: str) -> tuple[Backend, threading.Lock]:
        if label not in self.entries:
            raise DemoError(f"মডেলটি পাওয়া যায়নি (model not found): {label!r}")
        with self._load_lock:
            if label not in self._backends:
                e = self.entries[label]
                kwargs = {"threads": self.threads} if self.threads else {}
                try:
                    self._backends[label] = load(e.path, backend=e.backend, **kwargs)
                except (ValueError, OSError) as err:
                    raise DemoError(f"মডেলটি খোলা গেল না (could not load {e.path}): {err}") from None
        return self._backends[label], self._locks[label]

    def close(self) -> None:
        for b in self._backends.values():
            b.close()
        self._backends.clear()


def _text_of(content: object) -> str:
    """Gradio 6 message content (a string or a list of typed parts) -> plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or "")
    if isinstance(content, (list, tuple)):
        return "".join(_text_of(c) for c in content)
    return ""


def history_to_messages(history: list[dict] | None) -> list[dict]:
    out = []
    for m in history or []:
        role = m.get("role") if isinstance(m, dict) else None
        text = _text_of(m.get("content")) if isinstance(m, dict) else ""
        if role in ("user", "assistant") and text:
            out.append({"role": role, "content": text})
    return out


def format_stats(label: str, tokens: int, tps: float | None, ttft: float | None) -> str:
    speed = f"{tps:.1f} টোকেন/সেকেন্ড" if tps else "— টোকেন/সেকেন্ড"
    first = f" · প্রথম টোকেন {ttft * 1000:.0f} ms" if ttft is not None else ""
    return f"⚡ {speed} · {tokens} টোকেন{first} · {label}"


def make_respond(pool: ModelPool):
    def respond(message: str, history: list[dict] | None, model_label: str, max_tokens: float, temperature: float,
                top_k: float, top_p: float, repetition_penalty: float, seed: float | None
                ) -> Iterator[tuple[str, list[dict], str]]:
        message = (message or "").strip()
        if not message:
            raise gr.Error("একটি বার্তা লিখুন (the message is empty).")
        if len(message) > MAX_MESSAGE_CHARS:
            raise gr.Error(f"বার্তাটি খুব লম্বা: {len(message)} অক্ষর, সর্বোচ্চ {MAX_MESSAGE_CHARS} "
                           f"(message too long).")
        try:
            params = SamplingParams(max_new_tokens=int(max_tokens), temperature=float(temperature), top_k=int(top_k),
                                    top_p=float(top_p), repetition_penalty=float(repetition_penalty),
                                    seed=None if seed is None or int(seed) < 0 else int(seed)).validate()
            backend, lock = pool.get(model_label)
            messages = [*history_to_messages(history), {"role": "user", "content": message}]
            prepared, stream = chat_stream(backend, messages, params, lock)
        except PromptTooLong as e:
            raise gr.Error(f"বার্তাটি মডেলের প্রসঙ্গসীমার ({backend.n_ctx} টোকেন) চেয়ে লম্বা; ছোট করে লিখুন। ({e})") from None
        except ValueError as e:
            raise gr.Error(str(e)) from None
        notice = ""
        if prepared.dropped:
            notice = (f"ℹ️ কথোপকথন প্রসঙ্গসীমা ছাড়িয়ে গেছে: পুরোনো {prepared.dropped}টি বার্তা বাদ দেওয়া হয়েছে। "
                      f"({prepared.notice})\n\n")
            gr.Info(f"পুরোনো {prepared.dropped}টি বার্তা বাদ দেওয়া হয়েছে।")
        shown = [*(history or []), {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        yield "", shown, notice + "⏳ লিখছি…"
        reply = ""
        for piece in stream:
            reply += piece
            shown[-1] = {"role": "assistant", "content": reply}
            s = stream.stats
            yield "", shown, notice + format_stats(model_label, s.completion_tokens, s.tokens_per_s,
                                                   s.time_to_first_token_s)
        s = stream.stats
        if not reply:
            shown[-1] = {"role": "assistant", "content": "…"}  # the model ended its turn at once
        yield "", shown, notice + format_stats(model_label, s.completion_tokens, s.tokens_per_s,
                                               s.time_to_first_token_s)

    return respond


def build_app(entries: list[ModelEntry], threads: int | None = None) -> tuple[gr.Blocks, ModelPool]:
    if not entries:
        raise DemoError(f"no model to serve; {QUICKSTART_HINT}")
    pool = ModelPool(entries, threads)
    labels = [e.label for e in entries]
    defaults = SamplingParams()
    with gr.Blocks(title=TITLE) as app:
        gr.Markdown(f"# {TITLE}\n{DESCRIPTION}")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="কথোপকথন", placeholder=CHAT_PLACEHOLDER, height=460, elem_id="chatbot",
                                     buttons=["copy", "copy_all"])  # no "share" (it posts to the Hub)
                box = gr.Textbox(placeholder=PLACEHOLDER, show_label=False, lines=1, max_lines=6, autofocus=True,
                                 elem_id="message")
                with gr.Row():
                    send = gr.Button(SEND_LABEL, variant="primary", elem_id="send")
                    clear = gr.Button(CLEAR_LABEL)
                status = gr.Markdown("", elem_id="status")
            with gr.Column(scale=1):
                model = gr.Dropdown(labels, value=labels[0], label="মডেল", elem_id="model")
                max_tokens = gr.Slider(1, MAX_TOKENS_LIMIT, value=DEFAULT_MAX_TOKENS, step=1,
                                       label="সর্বোচ্চ নতুন টোকেন (max tokens)")
                temperature = gr.Slider(0.0, 2.0, value=defaults.temperature, step=0.05,
                                        label="তাপমাত্রা (temperature, 0 = নির্ধারিত)")
                top_k = gr.Slider(0, 200, value=defaults.top_k, step=1, label="top-k (0 = বন্ধ)")
                top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.01, label="top-p")
                rep = gr.Slider(1.0, 2.0, value=defaults.repetition_penalty, step=0.01,
                                label="পুনরাবৃত্তি দণ্ড (repetition penalty)")
                seed = gr.Number(value=-1, precision=0, label="সিড (seed, -1 = এলোমেলো)")
        gr.Examples(EXAMPLES, inputs=box, label="উদাহরণ")
        inputs = [box, chatbot, model, max_tokens, temperature, top_k, top_p, rep, seed]
        outputs = [box, chatbot, status]
        respond = make_respond(pool)
        # One concurrency group for both triggers; the per-model locks serialize each backend.
        common = {"concurrency_limit": len(entries), "concurrency_id": "generate"}
        box.submit(respond, inputs, outputs, api_name="chat", **common)
        send.click(respond, inputs, outputs, api_visibility="private", **common)
        clear.click(lambda: ([], ""), None, [chatbot, status], api_visibility="private")
    app.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)
    return app, pool


def launch(app: gr.Blocks, host: str = DEFAULT_HOST, port: int | None = DEFAULT_PORT, share: bool = False,
           block: bool = True, quiet: bool = False) -> str:
    """Start the server; returns its local URL (with block=False the call returns at once)."""
    _, url, _ = app.launch(server_name=host, server_port=port, share=share, inbrowser=False,
                           prevent_thread_lock=not block, quiet=quiet, show_error=True,
                           mcp_server=False, ssr_mode=False)
    return url

"""The Gradio chat demo, in Bangla: streaming replies, a picker among the run's exported models,
sampling controls and tokens/s, a model card (what you are talking to, from the run's files), a
"see the difference" tab (one prompt, two models, greedy, where their tokens part) and a tokenizer
tab (tokens coloured, characters/token beside the byte-level bound). Built on `serving` (one
Backend per model, loaded on first use).

Safety defaults: binds 127.0.0.1, no public share link unless asked, one generation at a time per
model (llama.cpp contexts are not re-entrant), messages capped in length, clear messages for a
missing model or a prompt longer than the context; a closed tab closes its reply stream, which
stops the generation and frees the model for the next user.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline: no telemetry, no version check

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import gradio as gr

from demo.compare import DEFAULT_COMPARE_TOKENS, FIRST_DIFF, MAX_COMPARE_TOKENS, SAME, compare, greedy_side
from demo.models import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    QUICKSTART_HINT,
    DemoError,
    ModelEntry,
    default_model,
    discover_models,
)
from demo.run_card import model_card
from demo.tokens import MAX_TOKENIZE_CHARS, N_COLOURS, token_view
from serving import Backend, SamplingParams, load
from serving.backends.llamacpp_lora import BASE_ONLY
from serving.chat_session import GenerationRequest, PromptTooLong, chat_tuned, open_stream
from serving.lora_pairs import Pairs
from serving.text_stream import ModelTurns
from training.evaluate import PROMPTS, read_prompts

__all__ = ["DemoError", "ModelEntry", "build_app", "default_model", "discover_models", "launch"]

TITLE = "প্রদীপ · বাংলা চ্যাট"
DESCRIPTION = (
    "প্রদীপ একটি ছোট বাংলা ভাষার মডেল, এই কম্পিউটারেই চলছে — কোনো তথ্য বাইরে যায় না। "
    "বাংলায় প্রশ্ন লিখুন, উত্তর শব্দে শব্দে আসবে। ডান দিক থেকে মডেল (GGUF, ONNX বা PyTorch) "
    "আর নমুনায়নের সেটিং বদলাতে পারেন।"
)
PLACEHOLDER = "এখানে বাংলায় আপনার বার্তা লিখুন…"
CHAT_PLACEHOLDER = "নমস্কার! আমি প্রদীপ। কিছু জিজ্ঞেস করুন।"
# the demo's examples are the first prompts training.evaluate scores for well-formedness: one list
EXAMPLES = read_prompts(PROMPTS)[:4]
SEND_LABEL, CLEAR_LABEL = "পাঠান", "নতুন কথোপকথন"
MAX_MESSAGE_CHARS = 4000  # far beyond any context we serve; refuses pasted novels before tokenizing
DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT = 128, 1024
QUEUE_MAX_SIZE = 32
CHAT_TAB, COMPARE_TAB, TOKENS_TAB = "চ্যাট", "পার্থক্য দেখুন (see the difference)", "টোকেনাইজার (tokenizer)"
CARD_LABEL = "এই মডেল সম্পর্কে (model card)"
COMPARE_CHAT, COMPARE_TEXT = "chat", "text continuation"
COMPARE_BUTTON, TOKENS_BUTTON = "তুলনা করুন (compare)", "টোকেন দেখুন (tokenize)"
COMPARE_HELP = ("একই প্রম্পট দুটি মডেলে, লোভী (greedy) ডিকোডিংয়ে: কোথায় তাদের টোকেন প্রথম আলাদা হয় — "
                "যেমন PyTorch fp32 বনাম GGUF Q4_K_M, কোয়ান্টাইজেশন কী বদলায় দেখতে। "
                "(One prompt, two models, greedy: the common prefix in green, the first differing token in red.)")
TOKENS_HELP = ("বাংলা লেখা দিন: প্রতিটি টোকেন আলাদা রঙে, আর প্রতি টোকেনে কত অক্ষর — বাইট-স্তরের টোকেনাইজারের পাশে। "
               "(Each token in its own colour; characters per token beside a byte-level tokenizer.)")
TOKENS_EXAMPLE = "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। চিরদিন তোমার আকাশ, তোমার বাতাস।"
BASE_NOTICE = ("ভিত্তি মডেল (base model, not chat-tuned): এটি চ্যাট শেখেনি, তাই আপনার লেখাটি চালিয়ে যাচ্ছে "
               "(it continues your text instead of answering).")
TOKEN_COLOURS = ("#fde68a", "#bfdbfe", "#bbf7d0", "#fecaca", "#ddd6fe", "#fed7aa")[:N_COLOURS]


class ModelPool:
    """Backends loaded on first use, each with its own turns (serving.text_stream.ModelTurns, the owner of
    one generation at a time per model). The LoRA pairs of one base GGUF (and the base alone) share its one
    backend and turns: the base is loaded once with all their adapters, and each pair is a view that sets
    its adapter per generation (serving.lora_pairs)."""

    def __init__(self, entries: list[ModelEntry], threads: int | None = None):
        self.entries = {e.label: e for e in entries}
        self.threads = threads
        self._backends: dict[tuple[str, Path], Backend] = {}  # by (runtime, model path): a pair's base once
        self._turns = {(e.backend, e.path): ModelTurns() for e in entries}
        self._load_lock = threading.Lock()

    def get(self, label: str) -> tuple[Backend, ModelTurns]:
        if label not in self.entries:
            raise DemoError(f"মডেলটি পাওয়া যায়নি (model not found): {label!r}")
        e = self.entries[label]
        key = (e.backend, e.path)
        lora = {x.adapter_name: x.adapter for x in self.entries.values() if (x.backend, x.path) == key and x.adapter}
        with self._load_lock:
            if key not in self._backends:
                kwargs = {"threads": self.threads} if self.threads else {}
                try:
                    self._backends[key] = load(e.path, backend=e.backend, **kwargs, **({"lora": lora} if lora else {}))
                except (ValueError, OSError) as err:
                    raise DemoError(f"মডেলটি খোলা গেল না (could not load {e.path}): {err}") from None
        backend = self._backends[key]
        if lora:  # one of the base's pairs, or the base alone
            backend = Pairs.of(backend).view(backend, e.adapter_name or BASE_ONLY)
        return backend, self._turns[key]

    def chat_tuned(self, label: str) -> bool | None:
        """Whether the model was chat fine-tuned (GGUF metadata, else its run files); None: unknown."""
        backend, _ = self.get(label)
        return chat_tuned(backend, self.entries[label].path)

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


def format_stats(runtime: str, tokens: int, tps: float | None, ttft: float | None, invalid_bytes: int = 0) -> str:
    """The status line under a reply: speed, and which runtime answered (e.g. llama.cpp-Q4_K_M).
    Plain text: no emoji, whose glyphs the page's fonts do not have (they would show as boxes)."""
    speed = f"{tps:.1f} টোকেন/সেকেন্ড" if tps else "— টোকেন/সেকেন্ড"
    first = f" · প্রথম টোকেন {ttft * 1000:.0f} ms" if ttft is not None else ""
    bad = f" · {invalid_bytes}টি অবৈধ বাইট-ক্রম বাদ (invalid UTF-8 dropped)" if invalid_bytes else ""
    return f"{speed} · {tokens} টোকেন{first}{bad} · উত্তর দিয়েছে (answered by) {runtime}"


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
        try:  # the widgets' settings are checked here, once, as they enter (SamplingParams); trusted after
            params = SamplingParams.from_user(
                max_new_tokens=int(max_tokens), temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                repetition_penalty=float(repetition_penalty), seed=None if seed is None or int(seed) < 0 else int(seed))
            backend, turns = pool.get(model_label)
            if pool.chat_tuned(model_label) is False:  # a base model: it never learned the chat template
                request = GenerationRequest(params, prompt=message)
            else:
                request = GenerationRequest(params, messages=[*history_to_messages(history),
                                                              {"role": "user", "content": message}])
            prepared, stream = open_stream(backend, request, turns)
        except PromptTooLong as e:
            raise gr.Error(f"বার্তাটি মডেলের প্রসঙ্গসীমার ({backend.n_ctx} টোকেন) চেয়ে লম্বা; ছোট করে লিখুন। ({e})") from None
        except ValueError as e:
            raise gr.Error(str(e)) from None
        notice = ""
        if prepared is None:
            notice = BASE_NOTICE + "\n\n"
        elif prepared.dropped:
            notice = (f"কথোপকথন প্রসঙ্গসীমা ছাড়িয়ে গেছে: পুরোনো {prepared.dropped}টি বার্তা বাদ দেওয়া হয়েছে। "
                      f"({prepared.notice})\n\n")
            gr.Info(f"পুরোনো {prepared.dropped}টি বার্তা বাদ দেওয়া হয়েছে।")
        shown = [*(history or []), {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        yield "", shown, notice + "লিখছি…"
        reply = ""
        pieces = iter(stream)
        try:
            for piece in pieces:
                reply += piece
                shown[-1] = {"role": "assistant", "content": reply}
                s = stream.stats
                yield "", shown, notice + format_stats(backend.name, s.completion_tokens, s.tokens_per_s,
                                                       s.time_to_first_token_s, s.invalid_bytes)
        finally:
            # A closed tab makes Gradio close this generator mid-reply: close the stream now (not at garbage
            # collection), so the generation stops and the model's lock is free for the next user.
            pieces.close()
        s = stream.stats
        if not reply:
            shown[-1] = {"role": "assistant", "content": "…"}  # the model ended its turn at once
        yield "", shown, notice + format_stats(backend.name, s.completion_tokens, s.tokens_per_s,
                                               s.time_to_first_token_s, s.invalid_bytes)

    return respond


def card_markdown(pool: ModelPool, label: str) -> str:
    """The selected model's card; a model that does not load gets its card without the runtime's facts."""
    entry = pool.entries.get(label)
    if entry is None:
        return f"মডেলটি পাওয়া যায়নি (model not found): {label!r}"
    try:
        backend, _ = pool.get(label)
    except DemoError as e:
        return f"{model_card(entry).markdown()}\n\n**সতর্কতা (warning):** {e}"
    return model_card(entry, backend).markdown()


def make_compare(pool: ModelPool):
    def run_compare(prompt: str, label_a: str, label_b: str, max_tokens: float, mode: str
                    ) -> tuple[str, list, list]:
        prompt = (prompt or "").strip()
        if not prompt:
            raise gr.Error("একটি বার্তা লিখুন (the prompt is empty).")
        if len(prompt) > MAX_MESSAGE_CHARS:
            raise gr.Error(f"বার্তাটি খুব লম্বা: {len(prompt)} অক্ষর, সর্বোচ্চ {MAX_MESSAGE_CHARS} (prompt too long).")
        n = int(max_tokens)
        if not 1 <= n <= MAX_COMPARE_TOKENS:
            raise gr.Error(f"max tokens must be in [1, {MAX_COMPARE_TOKENS}], got {n}")
        try:
            sides = []
            for label in (label_a, label_b):
                backend, turns = pool.get(label)
                sides.append(greedy_side(backend, turns, prompt, n, chat=mode == COMPARE_CHAT))
        except ValueError as e:  # DemoError, PromptTooLong, ServingError: one clear line
            raise gr.Error(str(e)) from None
        c = compare(*sides)
        return c.summary(), c.highlighted(c.a), c.highlighted(c.b)

    return run_compare


def make_tokenize(pool: ModelPool):
    def run_tokenize(text: str, label: str) -> tuple[list, str]:
        text = text or ""
        if not text.strip():
            raise gr.Error("কিছু বাংলা লেখা দিন (the text is empty).")
        if len(text) > MAX_TOKENIZE_CHARS:
            raise gr.Error(f"লেখাটি খুব লম্বা: {len(text)} অক্ষর, সর্বোচ্চ {MAX_TOKENIZE_CHARS} (text too long).")
        try:
            backend, _ = pool.get(label)  # tokenizing reads the vocabulary only: no generation lock
            view = token_view(backend, text)
        except ValueError as e:
            raise gr.Error(str(e)) from None
        return view.highlighted(), view.table(f"{label} (this model's tokenizer)")

    return run_tokenize


def default_pair(entries: list[ModelEntry]) -> tuple[str, str]:
    """PyTorch fp32 against a Q4_K_M GGUF when both are there: what quantization changed."""
    labels = [e.label for e in entries]
    torch = next((e.label for e in entries if e.backend == "torch"), labels[0])
    quant = next((e.label for e in entries if e.backend == "llama.cpp" and "Q4_K_M" in e.path.name), None)
    other = quant or next((lb for lb in labels if lb != torch), torch)
    return torch, other


def build_app(entries: list[ModelEntry], threads: int | None = None) -> tuple[gr.Blocks, ModelPool]:
    """The demo's Blocks (one builder per tab, each wiring its own events) and the pool it loads from."""
    if not entries:
        raise DemoError(f"no model to serve; {QUICKSTART_HINT}")
    pool = ModelPool(entries, threads)
    labels = [e.label for e in entries]
    # One concurrency group for every generation; each model's turns (ModelTurns) serialize its backend.
    common = {"concurrency_limit": len(entries), "concurrency_id": "generate"}
    with gr.Blocks(title=TITLE) as app:
        gr.Markdown(f"# {TITLE}\n{DESCRIPTION}")
        chat_tab(app, pool, labels, common)
        compare_tab(pool, entries, labels, common)
        tokens_tab(pool, labels)
    app.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)
    return app, pool


def chat_tab(app: gr.Blocks, pool: ModelPool, labels: list[str], common: dict) -> None:
    """The chat: conversation, message box, model picker, its card, sampling controls; the card is
    shown when the page loads and whenever the model changes."""
    defaults = SamplingParams()
    with gr.Tab(CHAT_TAB, id="chat"):
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="কথোপকথন", placeholder=CHAT_PLACEHOLDER, height=460,
                                     elem_id="chatbot", buttons=["copy", "copy_all"])  # no "share" (posts to the Hub)
                box = gr.Textbox(placeholder=PLACEHOLDER, show_label=False, lines=1, max_lines=6, autofocus=True,
                                 elem_id="message")
                with gr.Row():
                    send = gr.Button(SEND_LABEL, variant="primary", elem_id="send")
                    clear = gr.Button(CLEAR_LABEL)
                status = gr.Markdown("", elem_id="status")
            with gr.Column(scale=1):
                model = gr.Dropdown(labels, value=labels[0], label="মডেল", elem_id="model")
                with gr.Accordion(CARD_LABEL, open=True):
                    card = gr.Markdown(elem_id="card")
                with gr.Accordion("নমুনায়ন (sampling)", open=False):
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
    box.submit(respond, inputs, outputs, api_name="chat", **common)
    send.click(respond, inputs, outputs, api_visibility="private", **common)
    clear.click(lambda: ([], ""), None, [chatbot, status], api_visibility="private")
    show_card = partial(card_markdown, pool)
    model.change(show_card, model, card, api_name="card")
    app.load(show_card, model, card, api_visibility="private")


def compare_tab(pool: ModelPool, entries: list[ModelEntry], labels: list[str], common: dict) -> None:
    """See the difference: one prompt through two models, greedy, where their tokens part."""
    with gr.Tab(COMPARE_TAB, id="compare"):
        gr.Markdown(COMPARE_HELP)
        pair = default_pair(entries)
        with gr.Row():
            model_a = gr.Dropdown(labels, value=pair[0], label="মডেল ক (model A)", elem_id="model-a")
            model_b = gr.Dropdown(labels, value=pair[1], label="মডেল খ (model B)", elem_id="model-b")
        with gr.Row():
            cmp_prompt = gr.Textbox(value=EXAMPLES[0], label="প্রম্পট (prompt)", lines=1, max_lines=4,
                                    elem_id="compare-prompt", scale=3)
            cmp_mode = gr.Radio([COMPARE_CHAT, COMPARE_TEXT], value=COMPARE_CHAT, label="ধরন (mode)")
            cmp_tokens = gr.Slider(1, MAX_COMPARE_TOKENS, value=DEFAULT_COMPARE_TOKENS, step=1,
                                   label="নতুন টোকেন (new tokens)")
        cmp_go = gr.Button(COMPARE_BUTTON, variant="primary", elem_id="compare-go")
        cmp_summary = gr.Markdown(elem_id="compare-summary")
        diff_colours = {SAME: "green", FIRST_DIFF: "red"}
        with gr.Row():
            out_a = gr.HighlightedText(label="মডেল ক (A)", color_map=diff_colours, elem_id="compare-a",
                                       show_legend=True)
            out_b = gr.HighlightedText(label="মডেল খ (B)", color_map=diff_colours, elem_id="compare-b",
                                       show_legend=True)
    # Enter in a single-purpose text box does what its button does
    cmp_args = (make_compare(pool), [cmp_prompt, model_a, model_b, cmp_tokens, cmp_mode], [cmp_summary, out_a, out_b])
    cmp_go.click(*cmp_args, api_name="compare", **common)
    cmp_prompt.submit(*cmp_args, api_visibility="private", **common)


def tokens_tab(pool: ModelPool, labels: list[str]) -> None:
    """The tokenizer: each token of a text in its own colour, characters per token beside the bound."""
    with gr.Tab(TOKENS_TAB, id="tokens"):
        gr.Markdown(TOKENS_HELP)
        with gr.Row():
            # lines=1: Enter submits (as in the chat box); long text still wraps, up to max_lines
            tok_text = gr.Textbox(value=TOKENS_EXAMPLE, label="লেখা (text)", lines=1, max_lines=10,
                                  elem_id="tokens-text", scale=3)
            tok_model = gr.Dropdown(labels, value=labels[0], label="কোন মডেলের টোকেনাইজার (tokenizer of)")
        tok_go = gr.Button(TOKENS_BUTTON, variant="primary", elem_id="tokens-go")
        tok_spans = gr.HighlightedText(label="টোকেন (tokens)", elem_id="tokens-spans", show_inline_category=False,
                                       color_map={str(i): c for i, c in enumerate(TOKEN_COLOURS)})
        tok_table = gr.Markdown(elem_id="tokens-table")
    tok_args = (make_tokenize(pool), [tok_text, tok_model], [tok_spans, tok_table])
    tok_go.click(*tok_args, api_name="tokenize")
    tok_text.submit(*tok_args, api_visibility="private")


def launch(app: gr.Blocks, host: str = DEFAULT_HOST, port: int | None = DEFAULT_PORT, share: bool = False,
           block: bool = True, quiet: bool = False) -> str:
    """Start the server; returns its local URL (with block=False the call returns at once)."""
    _, url, _ = app.launch(server_name=host, server_port=port, share=share, inbrowser=False,
                           prevent_thread_lock=not block, quiet=quiet, show_error=True,
                           mcp_server=False, ssr_mode=False)
    return url

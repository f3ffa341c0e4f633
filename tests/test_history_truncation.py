"""Fitting a conversation to the context (issue 42, item 3): `training.text.chat_template.truncate_history` and the
foreign-template path `serving.chat_session.prepare_foreign_chat` keep the one-by-one definition's
result (drop the oldest non-system turn until the prompt fits; never the last message) at a cost
linear in the conversation (n log n renders' worth for an opaque template). The definitions the new
code must agree with are written out here, as they were in a87fbb0; the cost is counted in tokenizer
calls (no wall-clock assert)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from serving.chat_session import PromptTooLong, prepare_foreign_chat
from training.text.chat_template import ChatError, encode, truncate_history, validate

ROLES = ("system", "user", "assistant")


class CharTokens:
    """A tokenizer that is one token per character (what `encode` needs of one), counting its calls."""

    bos_id, im_start_id, im_end_id = 1, 2, 3

    def __init__(self, budget: int | None = None):
        self.calls, self.budget = 0, budget

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if self.budget is not None and self.calls > self.budget:
            raise AssertionError(f"more than {self.budget} tokenizer calls: the truncation is not linear")
        return [10 + ord(c) % 50 for c in text]


def old_truncate_history(tok, messages, max_tokens):
    """a87fbb0's definition: re-encode the whole conversation after every dropped turn."""
    msgs = validate(messages)
    dropped = 0
    while len(encode(tok, msgs).ids) > max_tokens:
        idx = next((i for i, m in enumerate(msgs) if m["role"] != "system"), None)
        if idx is None or idx == len(msgs) - 1:
            raise ChatError(f"the message alone is longer than the context ({max_tokens} tokens); shorten it")
        del msgs[idx]
        dropped += 1
    return msgs, dropped


def conversations(seed: int, count: int) -> list[list[dict]]:
    """Varied conversations: system prompts anywhere (or none), empty and long contents, NFC-normalized
    Bangla (conjuncts, a decomposed vowel sign that normalization composes), CRs, a final system message."""
    rng = random.Random(seed)
    words = ["ক", "বাংলা", "কি\u09be", "ক্ষ", "hello", "", "a\r\nb", "\ufeffx", "১২৩", "  "]
    out = []
    for _ in range(count):
        n = rng.randint(0, 12)
        msgs = [{"role": rng.choice(ROLES) if rng.random() < 0.3 else rng.choice(ROLES[1:]),
                 "content": " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))} for _ in range(n)]
        out.append(msgs)
    return out


def outcome(fn, tok, msgs, budget):
    try:
        return fn(tok, msgs, budget)
    except ChatError as e:
        return ("error", str(e))


def test_truncation_agrees_with_the_one_by_one_definition():
    """Every conversation, every budget from "nothing fits" to "everything fits": the same kept messages,
    the same count, or the same error."""
    compared = errors = dropped = 0
    for msgs in conversations(seed=42, count=100):
        full = len(encode(CharTokens(), msgs).ids)
        for budget in sorted({0, 1, full // 3, full // 2, full - 1, full, full + 5, *range(0, full, max(1, full // 12))}):
            want, got = outcome(old_truncate_history, CharTokens(), msgs, budget), outcome(
                truncate_history, CharTokens(), msgs, budget)
            assert got == want, (msgs, budget)
            compared += 1
            errors += isinstance(want, tuple) and want[0] == "error"
            dropped += not isinstance(want[0], str) and want[1] > 0
    assert compared > 1000 and errors > 100 and dropped > 300, (compared, errors, dropped)  # every branch taken


def test_truncation_of_10k_messages_is_linear():
    """10,001 one-letter messages into a context that keeps ~20: the one-by-one definition would encode
    the conversation ~10,000 times (~150 M tokenizer calls, minutes); the linear one calls the tokenizer
    a few times per message."""
    n = 10_001
    msgs = [{"role": "system", "content": "s"}] + [
        {"role": ("user", "assistant")[i % 2], "content": "ক"} for i in range(n - 1)]
    budget = 150
    tok = CharTokens(budget=4 * n)  # 3 calls a message (role, content, "\n") + the generation prompt
    kept, dropped = truncate_history(tok, msgs, budget)
    assert tok.calls <= 3 * n + 2, tok.calls
    assert kept[0] == msgs[0] and kept[-1] == msgs[-1] and dropped == n - len(kept)
    assert len(encode(CharTokens(), kept).ids) <= budget < len(encode(CharTokens(), [msgs[0], *msgs[-len(kept):]]).ids)
    assert kept[1:] == msgs[-(len(kept) - 1):] and dropped > 9_000


class TemplateBackend:
    """A foreign backend whose template is opaque (one string per conversation), counting renders."""

    n_ctx = 10_000
    chat_notice = None

    def __init__(self):
        self.rendered = 0  # characters rendered, over every call

    def render_chat(self, messages):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role'][0]}>" for m in messages) + "<assistant>"
        self.rendered += len(text)
        return text, ("</a>",)

    def tokenize(self, text, bos=True, allow_special=False):
        return [ord(c) for c in text]


def old_prepare_foreign_chat(backend, msgs, budget):
    """a87fbb0's definition: render, drop the oldest turn (and replies left leading), render again."""
    def oldest(kept):
        return next((i for i, m in enumerate(kept[:-1]) if m["role"] != "system"), None)

    kept, dropped = list(msgs), 0
    while True:
        text, _ = backend.render_chat(kept)
        ids = backend.tokenize(text)
        if len(ids) <= budget:
            return kept, dropped, ids
        i = oldest(kept)
        if i is None:
            raise PromptTooLong(f"{len(ids)}")
        del kept[i]
        dropped += 1
        while (i := oldest(kept)) is not None and kept[i]["role"] == "assistant":
            del kept[i]
            dropped += 1


def test_foreign_template_truncation_agrees_and_bisects():
    compared = 0
    for msgs in conversations(seed=7, count=120):
        msgs = validate(msgs)
        full = len(TemplateBackend().render_chat(msgs)[0])
        for budget in sorted({1, full // 4, full // 2, full - 1, full, *range(0, full, max(1, full // 12))}):
            try:
                want = old_prepare_foreign_chat(TemplateBackend(), msgs, budget)
            except PromptTooLong:
                with pytest.raises(PromptTooLong):
                    prepare_foreign_chat(TemplateBackend(), msgs, budget)
                continue
            got = prepare_foreign_chat(TemplateBackend(), msgs, budget)
            assert (got.messages, got.dropped, got.ids) == want, (msgs, budget)
            compared += 1
    assert compared > 500, compared
    # 5,001 messages: one-by-one renders ~n^2/2 characters; bisection ~n log n
    big = [{"role": ("user", "assistant")[i % 2], "content": "ক"} for i in range(5_001)]
    backend = TemplateBackend()
    got = prepare_foreign_chat(backend, big, budget=200)
    one_render = len(backend.render_chat(big)[0])
    assert got.dropped > 4_900 and backend.rendered <= 16 * one_render, (got.dropped, backend.rendered, one_render)


def test_what_the_server_prepares_is_unchanged_shape():
    """The prodip path through serving: a conversation that outgrows the context keeps the system prompt
    and the last message, and says how many were dropped."""
    from serving.chat_session import prepare_chat

    class Tiny(SimpleNamespace):
        name, n_ctx, prodip = "tiny", 64, True

        def tokenize(self, text, bos=True, allow_special=False):
            special = {"<|im_start|>": [2], "<|im_end|>": [3]}
            if allow_special and text in special:
                return special[text]
            return ([1] if bos else []) + [10 + ord(c) % 50 for c in text]

    from serving.backend import SamplingParams

    msgs = [{"role": "system", "content": "sys"}] + [{"role": "user", "content": f"m{i}"} for i in range(200)]
    prepared = prepare_chat(Tiny(), msgs, SamplingParams(max_new_tokens=8))
    assert prepared.messages[0]["role"] == "system" and prepared.messages[-1]["content"] == "m199"
    assert prepared.dropped == 201 - len(prepared.messages) > 150 and len(prepared.ids) <= 64 - 8

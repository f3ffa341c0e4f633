"""See the difference: one prompt, two models, greedy decoding, and where their tokens first part.

Through serving's Backend interface only, so any two loaded runtimes compare (PyTorch fp32 against a
Q4_K_M GGUF shows what quantization changed). Same tokenizer: tokens compare by id; different
tokenizers (a foreign GGUF): by the text each token spells. Gradio-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from demo.tokens import Span, spans
from serving import Backend, SamplingParams
from serving.chat_session import prepare_chat, prepare_completion
from serving.text_stream import GenerationStats, ModelTurns, bytes_decoder

MAX_COMPARE_TOKENS = 256  # both models run one after the other while the user waits
DEFAULT_COMPARE_TOKENS = 48
SAME, FIRST_DIFF = "same", "first difference"  # span labels in the tab's highlighted output


@dataclass
class Side:
    name: str
    prompt_ids: list[int]
    spans: list[Span]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.spans)

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.spans)


@dataclass
class Comparison:
    a: Side
    b: Side
    by_id: bool  # same tokenizer (the prompt tokenized to the same ids): compare ids, else token texts
    diverge: int | None  # index into the spans of the first difference; None: identical

    def _token_index(self, side: Side) -> int:
        return sum(len(s.ids) for s in side.spans[:self.diverge or 0])

    def highlighted(self, side: Side) -> list[tuple[str, str | None]]:
        """(text, label) for gr.HighlightedText: the common prefix, then the first differing token."""
        cut = len(side.spans) if self.diverge is None else self.diverge
        out: list[tuple[str, str | None]] = [(s.text, SAME) for s in side.spans[:cut]]
        if cut < len(side.spans):
            out.append((side.spans[cut].text, FIRST_DIFF))
            out += [(s.text, None) for s in side.spans[cut + 1:]]
        return out

    def summary(self) -> str:
        basis = "token ids (same tokenizer)" if self.by_id else "token texts (different tokenizers)"
        if self.diverge is None:
            return f"identical: {self.a.tokens} tokens, compared by {basis}."

        def tok(side: Side) -> str:
            if self.diverge >= len(side.spans):
                return "(ended)"
            s = side.spans[self.diverge]
            return f"{s.text!r} (id {', '.join(map(str, s.ids))})"

        return (f"first difference at generated token {self._token_index(self.a)} of {self.a.name} / "
                f"{self._token_index(self.b)} of {self.b.name}, after {self.diverge} matching tokens "
                f"(compared by {basis}): {self.a.name} → {tok(self.a)}, {self.b.name} → {tok(self.b)}.")


def first_divergence(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_side(backend: Backend, turns: ModelTurns, prompt: str, max_new_tokens: int, chat: bool) -> Side:
    """Greedy tokens of `backend` for `prompt` (through the chat template when `chat`), in its turn."""
    params = SamplingParams.greedy(max_new_tokens)
    if chat:
        ids = prepare_chat(backend, [{"role": "user", "content": prompt}], params).ids
    else:
        ids = prepare_completion(backend, prompt)
    with turns.hold(GenerationStats(prompt_tokens=len(ids))):
        gen = backend.generate(ids, params)
        try:
            out = [int(t) for t in gen]
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()
    return Side(backend.name, ids, spans(bytes_decoder(backend), out))


def compare(a: Side, b: Side) -> Comparison:
    by_id = a.prompt_ids == b.prompt_ids
    key = (lambda s: s.ids) if by_id else (lambda s: s.text)
    return Comparison(a, b, by_id, first_divergence([key(s) for s in a.spans], [key(s) for s in b.spans]))

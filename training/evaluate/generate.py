"""Well-formedness of generated text: greedy answers to a fixed set of prompts, scored by
`training.text.wellformed` (share of Bengali grapheme clusters a reader could write).

Bits per byte says how well a model predicts good text; it does not say whether what the model writes
is even valid script. A provider that can generate (`Generator`: a `RunnerScorer` over the base's
PyTorch `TransformerRunner`) answers each prompt greedily; the answers' clusters are counted together.
The default prompts are the demo's examples plus a few more (training/assets/chat/prompts_bn.txt).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from training.evaluate.providers import EvalError
from training.text.normalization import read_utf8
from training.text.wellformed import WellFormed

PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "chat" / "prompts_bn.txt"
GEN_TOKENS = 64  # new tokens per answer: a few sentences of Bangla at ~3 characters per token
MAX_SAMPLES = 4  # answers quoted in the report


@runtime_checkable
class Generator(Protocol):
    """A provider that can also answer: `prompt_ids` (chat-templated or plain), greedy ids, text."""

    name: str

    def prompt_ids(self, prompt: str, *, chat: bool) -> list[int]: ...

    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]: ...  # stops at end of turn

    def decode(self, ids: Sequence[int]) -> str: ...


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per non-empty line of a UTF-8 text file."""
    prompts = [line.strip() for line in read_utf8(path, "prompts file", EvalError).splitlines() if line.strip()]
    if not prompts:
        raise EvalError(f"{path}: no prompts (one per line)")
    return prompts


def generate_wellformed(gen: Generator, prompts: Sequence[str], *, max_new_tokens: int = GEN_TOKENS,
                        chat: bool = True) -> dict:
    """{"share", "clusters", "invalid", "examples", "prompts", "max_new_tokens", "chat", "samples"}."""
    wf = WellFormed()
    samples = []
    for p in prompts:
        text = gen.decode(gen.greedy(gen.prompt_ids(p, chat=chat), max_new_tokens))
        wf.add(text)
        samples.append({"prompt": p, "text": text})
    return {**wf.to_dict(), "prompts": len(prompts), "max_new_tokens": max_new_tokens, "chat": chat,
            "samples": samples[:MAX_SAMPLES]}

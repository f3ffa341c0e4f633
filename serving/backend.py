"""The one backend interface. Every runtime implements `Backend`; `serving.load(path)` picks the runtime.

A backend exposes the few primitives the rest of prodip needs:
- `tokenize` / `detokenize` (through the runtime's own tokenizer where it has one, so parity can
  check that it agrees with `training.tokenizer`),
- `logits(ids)`: next-token logits for every position of one sequence (fp32 numpy, (T, V)),
- `logits_incremental(ids, prefix)`: the same logits through the runtime's KV cache (`prefix` tokens
  in one pass, the rest one at a time), so parity can compare full-sequence and cached decoding,
- `generate(ids, params)`: a stream of token ids, sampled with `SamplingParams`,
- `chat(messages, params)`: renders through `training.chat` and streams text pieces,
- optionally `detokenize_bytes(ids)`: raw bytes, a lone byte-fallback token included (serving's stream
  decoder, serving.text_stream.bytes_decoder, reads them; without it, SentencePiece pieces are used).
Text given to a backend is normalized with `training.text.normalize` first, always.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Protocol, runtime_checkable

import numpy as np
from pydantic import Field

from training.schema import NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, SchemaError, Seed, check


class ServingError(ValueError):
    pass


# The sampling parameters' types, shared by SamplingParams, the `python -m serving` flags (`flag(T)`) and the
# HTTP request bodies, so all three refuse the same values with the same words. Strict: a JSON `true` or
# "0.5" is not a number, 2.0 is not a token count.
MAX_NEW_TOKENS = 1 << 16
MAX_TEMPERATURE = 10.0
MAX_PENALTY = 10.0
MaxNewTokens = Annotated[PositiveInt, Field(le=MAX_NEW_TOKENS, strict=True)]
Temperature = Annotated[NonNegFloat, Field(le=MAX_TEMPERATURE, strict=True)]  # 0 = greedy
MAX_TOP_K = 1 << 20  # past any vocabulary (Llama 3's is 128k): 10**12 is a typo, refused by value
TopK = Annotated[NonNegInt, Field(le=MAX_TOP_K, strict=True)]  # 0 = off
TopP = Annotated[PositiveFloat, Field(le=1, strict=True)]  # a probability; 0 would keep no token
RepetitionPenalty = Annotated[PositiveFloat, Field(le=MAX_PENALTY, strict=True)]
SamplingSeed = Annotated[Seed, Field(strict=True)]
SAMPLING_TYPES = {"max_new_tokens": MaxNewTokens, "temperature": Temperature, "top_k": TopK, "top_p": TopP,
                  "repetition_penalty": RepetitionPenalty, "seed": SamplingSeed}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    # 1 = off (CTRL-style: divide positive logits, multiply negative). Off by default, and the one default
    # every export carries (generation_config.json, genai_config.json): HF generate and transformers.js
    # apply it in greedy decoding too, so any other value there would change their greedy ids (docs/onnx.md).
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)

    def validate(self) -> SamplingParams:
        """Self, or ServingError naming the first field out of range (types from SAMPLING_TYPES)."""
        for name, type_ in SAMPLING_TYPES.items():
            value = getattr(self, name)
            if name == "seed" and value is None:
                continue
            try:
                check(type_, value, name, strict=True)
            except SchemaError as e:
                raise ServingError(str(e)) from None
        return self

    @classmethod
    def greedy(cls, max_new_tokens: int = 32) -> SamplingParams:
        return cls(max_new_tokens=max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)


@runtime_checkable
class Backend(Protocol):
    name: str  # e.g. "torch", "onnx-fp32", "llama.cpp-Q4_K_M"
    n_ctx: int
    eos_ids: tuple[int, ...]

    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def logits(self, ids: Sequence[int]) -> np.ndarray: ...

    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray: ...

    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]: ...

    def close(self) -> None: ...


# GGUF metadata key `python -m export` writes: True for a chat fine-tuned (SFT) run, False for a base one
CHAT_TUNED_KEY = "prodip.chat_tuned"
def sample_next(logits: np.ndarray, params: SamplingParams, history: Sequence[int], rng: np.random.Generator) -> int:
    """One sampling step shared by the PyTorch and ONNX backends (llama.cpp uses its own sampler)."""
    x = logits.astype(np.float64).copy()
    if params.repetition_penalty != 1.0 and len(history):
        seen = np.unique(np.asarray(history, dtype=np.int64))
        v = x[seen]
        x[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if params.temperature == 0:
        return int(np.argmax(x))
    x = x / params.temperature
    if params.top_k and params.top_k < x.size:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x[x < kth] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        cut = order[np.searchsorted(cum, params.top_p) + 1:]
        p[cut] = 0
        p /= p.sum()
    return int(rng.choice(p.size, p=p))

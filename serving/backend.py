"""The one backend interface. Every runtime implements `Backend`; `serving.load(path)` picks the runtime.

A backend is a `training.model.runner.Runner` (the one runner interface, which evaluation scores through)
plus generation. It exposes the few primitives the rest of prodip needs:
- `tokenize` / `detokenize` (through the runtime's own tokenizer where it has one, so parity can
  check that it agrees with `training.text.tokenizer`),
- `logits(ids)`: next-token logits for every position of one sequence (fp32 numpy, (T, V)),
- `logits_incremental(ids, prefix)`: the same logits through the runtime's KV cache (`prefix` tokens
  in one pass, the rest one at a time), so parity can compare full-sequence and cached decoding,
- `generate(ids, params)`: a stream of token ids, sampled with `SamplingParams`,
- `chat(messages, params)`: renders through `training.text.chat_template` and streams text pieces,
- optionally `detokenize_bytes(ids)`: raw bytes, a lone byte-fallback token included (serving's stream
  decoder, serving.text_stream.bytes_decoder, reads them; without it, SentencePiece pieces are used).
Text given to a backend is normalized with `training.text.normalization.normalize` first, always.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Protocol, runtime_checkable

import numpy as np
from pydantic import Field

from training.model.runner import Runner
from training.runfiles.schema import (
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    SchemaError,
    Seed,
    check,
)


class ServingError(ValueError):
    pass


# The sampling parameters' types, shared by SamplingParams, the `python -m serving` flags (`flag(T)`) and the
# HTTP request bodies, so all three refuse the same values with the same words. Strict: a JSON `true` or
# "0.5" is not a number, 2.0 is not a token count.
MAX_NEW_TOKENS = 1 << 16
DEFAULT_MAX_TOKENS = 256  # a request (HTTP body, CLI) that names no max_tokens
PENALTY_LAST_N = 64  # tokens repetition_penalty looks back over (llama-cpp-python's last_n_tokens_size default)
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


class SamplingError(ServingError):
    """A sampling setting SamplingParams refuses: `field` names it; the message is the schema's
    (`temperature = 11.0: Input should be ...`)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field

    def named(self, where: str) -> SamplingError:
        """The same refusal naming the setting as its user typed it (`max_tokens`, `repeat_penalty`)."""
        return SamplingError(where + str(self)[len(self.field):], self.field)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one reply: checked when it is made (every field against SAMPLING_TYPES, the schema
    types the CLI flags and HTTP bodies use) and frozen, so a SamplingParams is valid by construction and
    every layer after its entry (chat_session, text_stream, the backends) trusts it without a check."""

    max_new_tokens: int = 128
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    # 1 = off (CTRL-style: divide positive logits, multiply negative). Off by default, and the one default
    # every export carries (generation_config.json, genai_config.json): HF generate and transformers.js
    # apply it in greedy decoding too, so any other value there would change their greedy ids (docs/onnx.md).
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """The one check: SamplingError naming the first field out of range."""
        for name, type_ in SAMPLING_TYPES.items():
            value = getattr(self, name)
            if name == "seed" and value is None:
                continue
            try:  # the checked value is kept: a JSON 1 for a float field becomes 1.0
                object.__setattr__(self, name, check(type_, value, name, strict=True))
            except SchemaError as e:
                raise SamplingError(str(e), name) from None
        stop = self.stop
        if not isinstance(stop, str):  # one string is a mistake, not a sequence of one-letter stops
            with contextlib.suppress(TypeError):
                stop = tuple(stop)
        if not isinstance(stop, tuple) or not all(isinstance(s, str) for s in stop):
            raise SamplingError(f"stop = {self.stop!r}: stop must be a sequence of strings", "stop")
        object.__setattr__(self, "stop", stop)

    @classmethod
    def from_user(cls, names: Mapping[str, str] | None = None, **given: object) -> SamplingParams:
        """The builder for settings a user typed (an HTTP body, the CLI flags, the demo's widgets): a value
        None is not given (the default holds); a refused one is a SamplingError naming it as `names` say
        (field -> the user's name, e.g. {"max_new_tokens": "max_tokens"}), else by its field."""
        try:
            return cls(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
        except SamplingError as e:
            raise e.named((names or {}).get(e.field, e.field)) from None

    def with_stops(self, more: Sequence[str]) -> SamplingParams:
        """Self with `more` stop strings after its own (a chat template's end of turn), duplicates
        dropped; not checked again: both were checked already."""
        new = copy.copy(self)
        object.__setattr__(new, "stop", tuple(dict.fromkeys([*self.stop, *more])))
        return new

    @classmethod
    def greedy(cls, max_new_tokens: int = 32) -> SamplingParams:
        return cls(max_new_tokens=max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)


@runtime_checkable
class Backend(Runner, Protocol):
    """The base's `Runner` (name, n_ctx, eos_ids, tokenize/detokenize, logits, logits_incremental, an
    optional logits_batch) plus sampled generation and close: evaluation scores any Backend as a Runner."""

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

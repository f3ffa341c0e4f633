"""The one decode loop every Python runner drives: the prompt in one pass, then one token at a time
through the runner's KV cache. Torch-free: a runner supplies only its `Step` (PyTorch's `Transformer`
in training.model.kv_decode, ONNX Runtime and transformers in serving.backends), the caller its `pick`
(greedy for evaluation, serving's sampler for a chat). llama.cpp samples in C and does not use it.

Cancellation is the generator's: a consumer that stops iterating (or closes it) stops the decoding,
before the next step runs."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any, Protocol, TypeVar

Logits = TypeVar("Logits")  # a (T, V) block of next-token logits, in the runtime's own array type
Cache = TypeVar("Cache")  # the runtime's KV cache


class Step(Protocol[Logits, Cache]):
    """One forward pass of a runtime: `ids` fed at positions start..start+len(ids)-1 after `cache`
    (None: nothing yet, start is then 0). Returns the (T, V) logits of those positions and the cache
    grown by them; the loop never looks inside either beyond indexing a row of the logits."""

    def __call__(self, ids: list[int], start: int, cache: Cache | None, /) -> tuple[Logits, Cache]: ...


def decode(step: Step[Any, Any], ids: Sequence[int], budget: int, pick: Callable[[Any], int],
           stop: Container[int]) -> Iterator[int]:
    """Yield up to `budget` new ids, each `pick(row)` of the last position's (V,) logits row. An id in
    `stop` (end of turn) ends the stream and is not yielded. The caller bounds `budget` by the context
    and checks the ids; `ids` is read once, when the first id is asked for."""
    chunk, start, cache = [int(i) for i in ids], 0, None
    for _ in range(budget):
        logits, cache = step(chunk, start, cache)
        nxt = pick(logits[-1])
        if nxt in stop:
            return
        yield nxt
        start += len(chunk)
        chunk = [nxt]


def feed(step: Step[Logits, Any], ids: Sequence[int], prefix: int = 0) -> list[Logits]:
    """The logits blocks of `ids` through the cache: the first max(prefix, 1) ids in one pass, then one
    at a time (a runner's `logits_incremental`, which parity compares with its full-sequence pass)."""
    seq, cache, start, blocks = [int(i) for i in ids], None, 0, []
    for end in range(min(max(prefix, 1), len(seq)), len(seq) + 1):
        logits, cache = step(seq[start:end], start, cache)
        blocks.append(logits)
        start = end
    return blocks

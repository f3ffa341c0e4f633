"""Serving's sampling over the one decode loop (training.model.decode_loop): what the PyTorch, ONNX
Runtime and transformers backends' `generate` share. Each supplies its `Step` and how a logits row
becomes fp32 numpy; the loop, the budget, the end-of-turn ids and `sample_next` are the same for all."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from serving.backend import SamplingParams, sample_next
from training.model.decode_loop import Step, decode


def generate_ids(step: Step[Any, Any], ids: Sequence[int], params: SamplingParams, *, n_ctx: int,
                 eos_ids: Sequence[int], to_numpy: Callable[[Any], np.ndarray] = np.asarray) -> Iterator[int]:
    """Stream sampled ids; stops at an end-of-turn id (not yielded), max_new_tokens or the end of the
    context. The backend has checked `ids`. Stop strings are text-level: serving.chat_session applies them."""
    history = [int(i) for i in ids]
    rng = np.random.default_rng(params.seed)
    budget = min(params.max_new_tokens, n_ctx - len(history))

    def pick(row: Any) -> int:
        return sample_next(to_numpy(row), params, history, rng)

    for nxt in decode(step, history, budget, pick, eos_ids):
        history.append(nxt)  # the repetition penalty sees what was generated so far
        yield nxt

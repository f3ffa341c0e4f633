"""The one KV-cached decode loop over a `Transformer`: the prompt in one pass, then one token at a
time through the cache. Evaluation's greedy answers (training.evaluate.providers) and serving's
PyTorch backend (serving.torch_backend, any sampling) both run it; they differ only in `pick`."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence

import torch

from training.model import Transformer


def decode(model: Transformer, ids: Sequence[int], budget: int, pick: Callable[[torch.Tensor], int],
           stop: Container[int]) -> Iterator[int]:
    """Yield up to `budget` new ids, each `pick(logits)` of the last position's (V,) logits row. An id
    in `stop` (end of turn) ends the stream and is not yielded. The caller bounds `budget` by the
    context and runs this under no_grad/inference_mode."""
    device = next(model.parameters()).device
    x = torch.as_tensor([list(ids)], dtype=torch.long, device=device)
    pos, past, n = torch.arange(x.shape[1], device=device)[None], None, x.shape[1]
    for _ in range(budget):
        logits, past = model.forward_with_cache(x, pos, past)
        nxt = pick(logits[0, -1])
        if nxt in stop:
            return
        yield nxt
        x = torch.tensor([[nxt]], dtype=torch.long, device=device)
        pos = torch.tensor([[n]], device=device)
        n += 1

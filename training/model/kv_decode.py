"""A `Transformer`'s step for the one decode loop (training.model.decode_loop): a forward pass through
`forward_with_cache`. The base's PyTorch runner (training.model.runner.TransformerRunner: greedy answers,
logits_incremental) and serving's PyTorch backend (its sampling) both drive the loop with it."""

from __future__ import annotations

import torch

from training.model.decode_loop import Step
from training.model.decoder import Transformer

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # forward_with_cache's presents: (k, v) per layer


def transformer_step(model: Transformer) -> Step[torch.Tensor, KVCache]:
    """The step over `model` on its own device: (T, V) fp32 logits of `ids` at positions start.., and the
    grown cache. The caller runs the loop under no_grad/inference_mode."""
    device = next(model.parameters()).device

    def step(ids: list[int], start: int, cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        x = torch.tensor([ids], dtype=torch.long, device=device)
        pos = torch.arange(start, start + len(ids), device=device)[None]
        logits, cache = model.forward_with_cache(x, pos, cache)
        return logits[0], cache

    return step

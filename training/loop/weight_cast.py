"""bf16 weight copies made once per optimizer step (`CastOnce`), for a single-process run under bf16 autocast.

Autocast casts every fp32 weight to bf16 at each use, so with --grad-accum N each block matrix is read
in fp32 and written in bf16 N times per optimizer step (inside the compiled blocks too: there the cast is
a kernel of the graph). `CastOnce` is the object a step calls instead of the model: at the step's first
forward it casts the block matrices once (`w.to(bf16)`, a differentiable op) and calls the model with
those copies in place of its parameters (`torch.func.functional_call`) for every micro-batch of the
step, then drops them. The arithmetic is autocast's own: the same bf16 values reach the same matmuls
(autocast passes a bf16 tensor through), and each micro-batch's bf16 weight gradient flows back through
the cast into the fp32 parameter's `.grad`, accumulated in fp32 exactly as before. So the fp32 master
weights, their gradients and their update are the plain path's, bit for bit on the CPU
(tests/test_weight_cast.py).

Not cast: the embedding (tied to the output head: its gradient accumulates over many rows, kept in
fp32) and the 1-D norm weights (RMSNorm computes in fp32). Not used under DDP/FSDP2 (FSDP2 casts its
own all-gathered parameters; DDP's hooks see the fp32 parameters either way, but it is not measured).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def cast_names(model: nn.Module) -> list[str]:
    """The parameters cast once per step: the transformer blocks' matrices."""
    return [n for n, p in model.named_parameters() if p.dim() >= 2 and n.startswith("layers.")]


class CastOnce(nn.Module):
    """Calls `inner` with bf16 copies of its block matrices, made once per `hold()` (one optimizer step)
    or, outside one, once per call. Every other attribute (training mode, parameters) is `inner`'s."""

    casts_once = True  # what training.gates.model_gates.nonreference_paths names

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype
        self.names = cast_names(inner)
        self._held: dict[str, torch.Tensor] | None = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """One optimizer step: the copies made at its first forward serve every micro-batch, and are
        dropped on exit (before the optimizer changes the fp32 weights they were cast from)."""
        self._held = {}
        try:
            yield
        finally:
            self._held = None

    def casts(self) -> dict[str, torch.Tensor]:
        if self._held:
            return self._held
        params = dict(self.inner.named_parameters())
        out = {n: params[n].to(self.dtype) for n in self.names}
        if self._held is not None and torch.is_grad_enabled():  # held for the step's later micro-batches
            self._held.update(out)
        return out

    def forward(self, *args, **kwargs):
        return torch.func.functional_call(self.inner, self.casts(), args, kwargs, strict=False)

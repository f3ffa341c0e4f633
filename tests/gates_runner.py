"""Run `training.train.main` with one planted defect (for the end-to-end gate tests).

    python tests/gates_runner.py PLANT [train.py arguments ...]

PLANT: none | zero_grad_ffn | zero_grad_ffn_under_ac | nan_loss_at:K | nan_loss_from:K | nan_grad_at:K | detach_from:K | spike_at:K.
The plant is built into the model class train.py instantiates, so it lives in the exact object
that trains; K counts training steps (pre-flight gates run at step 0). Under torchrun, `PLANT@R`
plants it in rank R alone (the other ranks train a healthy model).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import gates_plants as P  # noqa: E402

import training.train as T  # noqa: E402

PLANTS = ("none", "zero_grad_ffn", "zero_grad_ffn_under_ac", "nan_loss_at", "nan_loss_from", "nan_grad_at", "detach_from", "spike_at")
SPIKE_FACTOR = 10.0  # a bad batch: loss x10


@contextlib.contextmanager
def planted(spec: str):
    spec, _, only_rank = spec.partition("@")
    if only_rank and int(os.environ.get("RANK", "0")) != int(only_rank):
        spec = "none"
    kind, _, arg = spec.partition(":")
    if kind not in PLANTS:
        raise SystemExit(f"unknown plant {spec!r}; choose from {PLANTS}")
    k = int(arg) if arg else 0
    base, base_lr = T.Transformer, T.lr_at

    def lr_at(step, **kw):
        P.STEP["now"] = step  # called once at the start of every training step
        return base_lr(step, **kw)

    class Planted(base):
        def __init__(self, cfg):
            super().__init__(cfg)
            if kind == "zero_grad_ffn":
                P.fused_ffn(self, P.ZeroGradSwiGLU, layer=0)
            elif kind == "zero_grad_ffn_under_ac":
                P.zero_grad_ffn_when_recomputed(self, layer=0)
            elif kind == "nan_grad_at":
                P.NaNGradAtStep.at = k
                P.fused_ffn(self, P.NaNGradAtStep, layer=1)
            elif kind == "detach_from":
                P.detach_attention_from(self, k, layer=1)

        def forward(self, idx, targets=None, **kw):
            out = super().forward(idx, targets, **kw)
            now = P.STEP["now"]
            if targets is not None and now > 0 and (
                    (kind == "nan_loss_at" and now == k) or (kind == "nan_loss_from" and now >= k)):
                logits, loss = out
                return logits, loss * float("nan")
            if targets is not None and kind == "spike_at" and now == k:
                logits, loss = out
                return logits, loss * SPIKE_FACTOR
            return out

    T.Transformer, T.lr_at = Planted, lr_at
    try:
        yield
    finally:
        T.Transformer, T.lr_at = base, base_lr
        P.STEP["now"] = 0


def run(plant: str, argv: list[str]) -> int:
    with planted(plant):
        return T.main(argv)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    sys.exit(run(sys.argv[1], sys.argv[2:]))

"""Validator: the mean validation loss over the fixed validation batches (all ranks), and bits per
byte when the data knows its bytes per token, on its cadence (every --eval-every steps and the last)."""

from __future__ import annotations

import math

import torch

from training import distributed as D
from training.config_sections import ValidationSection
from training.data.loaders import TrainingData
from training.loop.step import ModelViews, to_device
from training.run_context import RunContext


class Validator:
    def __init__(self, section: ValidationSection, ctx: RunContext, data: TrainingData, views: ModelViews):
        self.cfg, self.dist, self.data, self.views = section, ctx.dist, data, views
        self.last: dict | None = None  # the newest result, for the progress line and the summary

    def should_validate(self, step: int, *, last: bool) -> bool:
        every = self.cfg.eval_every
        return bool(self.data.val and every and (step % every == 0 or last))

    @torch.no_grad()
    def validate(self) -> dict:
        """The validation loss, through the eager code of compiled blocks (D.eager): no second graph (no_grad,
        a short last batch) compiled mid-run, no second graph's memory, and forward-only eager costs little."""
        fwd, v = self.views.forward_model, self.views
        was = fwd.training
        fwd.eval()
        losses = []
        with D.eager():
            for batch in self.data.val(self.cfg.eval_batches):
                x, y, mask = to_device(batch, v.device)
                with v.autocast():
                    _, loss = fwd(x, y, loss_mask=mask, return_logits=False)  # the chunked loss: no logits held
                losses.append(loss.float())
        fwd.train(was)
        val = self.dist.mean(torch.stack(losses).mean()).item()
        out = {"val_loss": val}
        if self.data.bytes_per_token:
            out["val_bpb"] = val / math.log(2) / self.data.bytes_per_token
        self.last = out
        return out

"""Planted defects for the gate suite: each is a real PyTorch failure injected into the exact object
that trains (a patched instance method, a custom autograd.Function, a wrapped optimizer or loader).

Used in-process by tests/test_gates.py and, through tests/gates_runner.py, by `train.main`.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------ "fused" autograd.Functions


class ZeroGradSwiGLU(torch.autograd.Function):
    """A fused SwiGLU whose forward is right and whose backward silently returns zeros."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3):
        ctx.save_for_backward(x, w1, w2, w3)
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    @staticmethod
    def backward(ctx, g):
        return tuple(torch.zeros_like(t) for t in ctx.saved_tensors)


class CrashingSwiGLU(ZeroGradSwiGLU):
    """A fused path that crashes in its backward (as the reference run's fusion path did mid-run)."""

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("fused_swiglu_backward: illegal memory access (planted)")


class ScaledGradSwiGLU(torch.autograd.Function):
    """Exact forward; backward off by a factor (a fused kernel that forgets a term)."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3):
        with torch.enable_grad():
            xs, ws = x.detach().requires_grad_(), [w.detach().requires_grad_() for w in (w1, w2, w3)]
            out = F.linear(F.silu(F.linear(xs, ws[0])) * F.linear(xs, ws[2]), ws[1])
        ctx.save_for_backward(xs, *ws, out)
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        xs, w1, w2, w3, out = ctx.saved_tensors
        grads = torch.autograd.grad(out, (xs, w1, w2, w3), g)
        return tuple(0.5 * t for t in grads)


class NaNGradSwiGLU(ScaledGradSwiGLU):
    """Exact forward and input gradient; the weight gradients overflow to NaN (a fused kernel's
    fp16 accumulator)."""

    @staticmethod
    def backward(ctx, g):
        xs, w1, w2, w3, out = ctx.saved_tensors
        grads = torch.autograd.grad(out, (xs, w1, w2, w3), g)
        return grads[0], *(torch.full_like(t, float("nan")) for t in grads[1:])


class DeadRowsLinear(torch.autograd.Function):
    """A fused projection whose backward drops the weight gradient of the second half of its rows."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        gw[w.shape[0] // 2:] = 0
        return g @ w, gw


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a backward kernel at a fraction of the hardware's speed."""

    seconds = 0.2

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(SlowBackward.seconds)
        return g


class SlowBoth(torch.autograd.Function):
    """Identity whose forward and backward both sleep: an unfused, launch-bound step."""

    seconds = 0.5

    @staticmethod
    def forward(ctx, x):
        time.sleep(SlowBoth.seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(SlowBoth.seconds)
        return g


# ------------------------------------------------------------------------------------- plants
def _ffn_with(fn):
    def forward(self, x):
        return fn.apply(x, self.w1.weight, self.w2.weight, self.w3.weight)
    return forward


def fused_ffn(model, fn=ZeroGradSwiGLU, layer: int = 0) -> list[str]:
    """Route layer `layer`'s feed-forward through a "fused" Function; returns the parameters whose
    gradient it breaks (a zero input gradient also starves the block's ffn_norm)."""
    ff = model.layers[layer].feed_forward
    ff.forward = types.MethodType(_ffn_with(fn), ff)
    names = [f"layers.{layer}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
    return names + ([f"layers.{layer}.ffn_norm.weight"] if fn is ZeroGradSwiGLU else [])


def zero_grad_ffn_when_recomputed(model, layer: int = 0) -> list[str]:
    """A "fused" feed-forward that loses its gradient only on the activation-checkpointing path (as a
    kernel may misbehave under recomputation): a run without --activation-checkpointing is healthy."""
    ff = model.layers[layer].feed_forward
    plain, broken = ff.forward, types.MethodType(_ffn_with(ZeroGradSwiGLU), ff)
    ff.forward = lambda *a, **k: (broken if model.activation_checkpointing else plain)(*a, **k)
    return [f"layers.{layer}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]


def detach_attention(model, layer: int = 0) -> list[str]:
    """A branch detached from the graph: the attention output of one block (`.detach()` left in)."""
    blk = model.layers[layer]
    attn_forward = blk.attention.forward

    def forward(self, *args, **kwargs):
        a, present = attn_forward(*args, **kwargs)
        return a.detach(), present

    blk.attention.forward = types.MethodType(forward, blk.attention)
    return [f"layers.{layer}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")] + [f"layers.{layer}.attention_norm.weight"]


def freeze(model, name: str = "layers.1.ffn_norm.weight") -> str:
    """A parameter frozen by mistake (left over from a fine-tuning experiment)."""
    dict(model.named_parameters())[name].requires_grad_(False)
    return name


def dead_rows(model, layer: int = 0) -> str:
    lin = model.layers[layer].attention.wq

    def forward(self, x):
        return DeadRowsLinear.apply(x, self.weight)

    lin.forward = types.MethodType(forward, lin)
    return f"layers.{layer}.attention.wq.weight"


def gelu_ffn(model, layer: int = 1) -> None:
    """A "fused" feed-forward that approximates SiLU by GELU: numerically different from eager."""
    ff = model.layers[layer].feed_forward

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))

    ff.forward = types.MethodType(forward, ff)


def slow_blocks(model, fn=SlowBackward) -> None:
    """Every block's output passes through a slow identity (backward, or both directions)."""
    for blk in model.layers:
        orig = blk.forward

        def forward(self, *args, _orig=orig, **kwargs):
            h, present = _orig(*args, **kwargs)
            return fn.apply(h), present

        blk.forward = types.MethodType(forward, blk)


def stale_optimizer(factory):
    """An optimizer built over stale copies of the parameters (created before a re-wrap/move):
    it steps tensors the model never uses."""
    def make(model):
        class Stale(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ps = torch.nn.ParameterList(torch.nn.Parameter(p.detach().clone()) for p in model.parameters())
        return factory(Stale())
    return make


class RepeatingLoader:
    """Wraps a loader and returns its first batch forever (a cached-iterator bug)."""

    def __init__(self, inner):
        self.inner = inner
        self.first = None

    def next_batch(self, batch_size):
        if self.first is None:
            self.first = self.inner.next_batch(batch_size)
        else:
            self.inner.next_batch(batch_size)  # position advances as if new data came
        return self.first

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "cached": self.first is not None}

    def load_state_dict(self, s):
        self.inner.load_state_dict(s["inner"])


# ------------------------------------------------------------------ defects that appear at step k
STEP = {"now": 0}  # the training step in progress (set by tests/gates_runner.py; 0 during pre-flight)


class NaNGradAtStep(ScaledGradSwiGLU):
    """Exact forward and backward, except at training step STEP_AT where the backward overflows to NaN."""

    at = 0

    @staticmethod
    def backward(ctx, g):
        xs, w1, w2, w3, out = ctx.saved_tensors
        grads = torch.autograd.grad(out, (xs, w1, w2, w3), g)
        if STEP["now"] == NaNGradAtStep.at:
            return grads[0], *(torch.full_like(t, float("nan")) for t in grads[1:])
        return grads


def detach_attention_from(model, step: int, layer: int = 1) -> None:
    """A branch that detaches from the graph from training step `step` on (a code path taken late)."""
    attn = model.layers[layer].attention
    attn_forward = attn.forward

    def forward(self, *args, **kwargs):
        a, present = attn_forward(*args, **kwargs)
        return (a.detach() if STEP["now"] >= step else a), present

    attn.forward = types.MethodType(forward, attn)

"""Model pre-flight gates: gradient flow, frozen parameters, compiled vs eager, overfit one batch,
throughput.

Each gate runs on the exact object that trains (`ctx.model`: after DDP/FSDP2 and torch.compile); none
consumes training data, every gradient it makes is cleared before it returns, and the one that must
change weights (overfit) restores them. What goes through the compiled object goes at the real
micro-batch shape: another batch size would make dynamo recompile with a dynamic batch dimension,
and training could then run on that slower graph.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as tdist

from training import distributed as D
from training.gates.context import PreflightContext
from training.gates.runtime import full_grad, gradient_flow_from_grads
from training.gates.tolerance import (
    FLOOR_JITTER,
    FLOOR_K,
    FLOOR_PRECISIONS,
    compare,
    low_precision_tolerance,
    reference_pass,
    rel_error,  # noqa: F401 (re-exported: training.gates.model_gates.rel_error)
    verdict,
)
from training.model.decoder import Transformer, count_params
from training.runfiles.gate_results import GateResult

# compiled vs eager: relative L2 error ||a - b|| / ||b|| per tensor, (logits, gradients), by the
# compute precision. fp32: reordered reductions (compile, fused kernels) stay near 1e-6; TF32 matmuls
# (10-bit mantissa) near 1e-3. bf16 (8-bit mantissa), measured on CPU under bf16 autocast (docs/gates.md,
# "bf16 tolerances"): healthy paths reach 2.1e-5 in the logits and 1.3e-2 in the gradients (FSDP2 with
# bf16 parameters; inductor 6.8e-3), while GELU-for-SiLU in one block measures 9.7e-2 and a gradient off
# by a factor 0.5: the tolerance sits ~3x above the first and ~2.4x below the second (5e-2/1e-1, the
# earlier guess, let GELU through).
TOLERANCE = {"fp32": (1e-3, 1e-3), "tf32": (1e-2, 2e-2), "fp16": (2e-2, 5e-2), "bf16": (2e-2, 4e-2)}
PRECISION = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

OVERFIT_STEPS = 100  # budget; early stop at the target. tiny preset: 6-22 steps at lr 1e-3..1e-4
OVERFIT_DROP = 0.5  # the loss must fall by at least this fraction
OVERFIT_ROWS = 2  # through the eager object (not compiled), so another shape costs no recompile

THROUGHPUT_WARMUP = 1  # first call compiles/allocates: not timed
THROUGHPUT_STEPS = 3  # medians of this many forward / backward timings
MFU_FLOOR = 0.25  # enforced for models of at least MFU_MIN_PARAMS parameters, on CUDA
MFU_MIN_PARAMS = 100_000_000
MAX_BACKWARD_RATIO = 3.5  # backward ~2x forward is normal; the reference defect ran at ~30x
RECOMPUTE_ALLOWANCE = 1.0  # activation checkpointing re-runs the forward inside the backward

# Modules of these packages are the reference path (torch.distributed: FSDP2's generated classes).
REFERENCE_MODULE_PREFIXES = ("training.model.decoder", "torch.nn", "torch.distributed")

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # inputs, targets, loss mask (SFT) or None


# ------------------------------------------------------------------------------------ helpers
def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _dist_enabled(ctx: PreflightContext) -> bool:
    return ctx.dist.enabled and tdist.is_available() and tdist.is_initialized()


def _broadcast(ctx: PreflightContext, t: torch.Tensor | None) -> torch.Tensor | None:
    """Rank 0's tensor on every rank (shapes may differ per rank: SFT batches are padded per batch)."""
    if t is None:
        return None
    shape = torch.tensor(list(t.shape), device=t.device)
    tdist.broadcast(shape, src=0)
    out = t if tuple(shape.tolist()) == tuple(t.shape) else torch.empty(shape.tolist(), dtype=t.dtype, device=t.device)
    tdist.broadcast(out, src=0)
    return out


def peek_batch(ctx: PreflightContext, rows: int | None = None, same_on_all_ranks: bool = False) -> Batch:
    """The next real training batch (x, y, mask or None) on the device, without consuming it."""
    loader = ctx.batches.train
    state = loader.state_dict()
    try:
        batch = loader.next_batch(ctx.cfg.batch_size)
    finally:
        loader.load_state_dict(state)
    x, y = batch[0], batch[1]
    mask = batch[2] if len(batch) > 2 else None
    if rows:
        x, y = x[:rows], y[:rows]
        mask = None if mask is None else mask[:rows]
    x, y = x.to(ctx.device), y.to(ctx.device)
    mask = None if mask is None else mask.to(ctx.device)
    if same_on_all_ranks and _dist_enabled(ctx):
        x, y, mask = _broadcast(ctx, x), _broadcast(ctx, y), _broadcast(ctx, mask)
    return x, y, mask


def autocast_dtype(ctx: PreflightContext) -> torch.dtype:
    kind = torch.device(ctx.device).type
    with ctx.autocast():
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    return next(ctx.raw_model.parameters()).dtype


def precision(ctx: PreflightContext) -> str:
    """fp32 | tf32 | fp16 | bf16: what the matmuls of a training step actually compute in."""
    p = PRECISION.get(autocast_dtype(ctx), "bf16")
    if p == "fp32" and torch.device(ctx.device).type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return p


def _sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def _full_weights(ctx: PreflightContext) -> dict[str, torch.Tensor]:
    if _sharded(ctx.raw_model):
        return D.full_model_state(ctx.model)  # a collective: every rank runs the gates
    return {k: v.detach() for k, v in ctx.raw_model.state_dict().items()}


def reference_model(ctx: PreflightContext) -> Transformer:
    """A fresh eager `training.model.decoder.Transformer` holding the trained object's weights."""
    weights = _full_weights(ctx)
    with torch.device(ctx.device):
        ref = Transformer(ctx.model_cfg)
        if (spec := getattr(ctx.raw_model, "lora_spec", None)) is not None:  # an adapter run: the same adapters
            from training.model.lora import add_adapters

            add_adapters(ref, spec)
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"the trained object's parameters do not match the reference model's "
                         f"(missing {list(missing)[:4]}, unexpected {list(unexpected)[:4]})")
    return ref.train(ctx.raw_model.training)


def eager_object(ctx: PreflightContext) -> torch.nn.Module:
    """The trained object without torch.compile: the DDP/FSDP2-wrapped model (or the model itself); its
    compiled blocks run eagerly only inside D.eager()."""
    return getattr(ctx.model, "_orig_mod", ctx.model)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (a view: writing it writes the parameter), else `p`."""
    return p.to_local() if hasattr(p, "to_local") else p


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """A host copy of this rank's share of every parameter (its FSDP2 shard; no full copy anywhere)."""
    D.reshard(model)  # a forward without its backward leaves FSDP2's root gathered: shards only
    with torch.no_grad():
        return [_local(p).detach().to("cpu", copy=True) for p in model.parameters()]


def restore(model: torch.nn.Module, saved: list[torch.Tensor]) -> None:
    D.reshard(model)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved, strict=True):
            _local(p).copy_(s)


def nonreference_paths(ctx: PreflightContext) -> list[str]:
    """What makes the trained object differ from the plain eager reference implementation."""
    out = []
    if ctx.cfg.compile:
        out.append("torch.compile")
    if ctx.raw_model.activation_checkpointing:
        out.append("activation checkpointing")
    if _dist_enabled(ctx):
        out.append("FSDP2" if ctx.cfg.fsdp else "DDP")
    if getattr(ctx.model, "casts_once", False):
        out.append("bf16 weights cast once per step")
    for name, m in ctx.raw_model.named_modules():
        if "forward" in vars(m) or not type(m).__module__.startswith(REFERENCE_MODULE_PREFIXES):
            out.append(f"{name or 'model'} ({type(m).__name__})")
    return out


# ------------------------------------------------------------------- frozen / gradient flow
def frozen_parameters(model: torch.nn.Module) -> GateResult:
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return GateResult("frozen_parameters", not frozen, value=float(len(frozen)), threshold="0",
                      detail=("frozen by mistake? " + ", ".join(frozen)) if frozen else "every parameter is trainable")


def gradient_flow(ctx: PreflightContext) -> GateResult:
    """One forward/backward on a real training batch through the exact object that trains."""
    x, y, mask = peek_batch(ctx)
    raw = ctx.raw_model
    zero_grads(raw)
    with ctx.autocast():
        _, loss = ctx.model(x, y, loss_mask=mask)
    loss.backward()
    result = gradient_flow_from_grads(raw.named_parameters())
    zero_grads(raw)
    return result


# ------------------------------------------------------------------------- compiled vs eager
def compiled_vs_eager(ctx: PreflightContext, rows: int | None = None,
                      tolerance: tuple[float, float] | None = None) -> GateResult:
    """Logits and every parameter gradient of the trained object vs a fresh eager reference model,
    on the real micro-batch (`rows`: fewer rows, for a test of an uncompiled object only).
    `tolerance`: (logits, gradients) relative L2 error; default: fp32/tf32 fixed (TOLERANCE), bf16/fp16
    derived from this model's measured rounding floor (low_precision_tolerance)."""
    prec = precision(ctx)
    paths = nonreference_paths(ctx)
    # the same rows on every rank: DDP/FSDP average gradients, which then equal the local reference
    batch = peek_batch(ctx, rows, same_on_all_ranks=True)
    x, y, mask = batch
    raw = ctx.raw_model

    zero_grads(raw)
    with ctx.autocast():
        logits, loss = ctx.model(x, y, loss_mask=mask)
    loss.backward()
    # a forward that returns no logits in training (a fused loss) is compared by its loss
    want_logits = logits is not None
    got_out = (logits if want_logits else loss).detach().float()
    del logits, loss
    got = {n: (None if p.grad is None else full_grad(p.grad).detach().float().clone())
           for n, p in raw.named_parameters() if p.requires_grad}
    zero_grads(raw)

    ref = reference_model(ctx)
    base = reference_pass(ref, ctx, batch, want_logits)
    errors = compare(got_out, got, *base)
    del got, got_out
    how = f"{prec} tolerance"
    if tolerance is None and prec in FLOOR_PRECISIONS:
        tol_logits, tol_grads, fl, fg = low_precision_tolerance(ref, ctx, batch, want_logits, base)
        how = f"{prec} tolerance = {FLOOR_K:g} x this model's floor"
        floor = f"; {prec} floor (eager vs eager, weights jittered by {FLOOR_JITTER:.3g}): {fl:.2e} / {fg:.2e}"
    else:
        tol_logits, tol_grads = tolerance or TOLERANCE[prec]
        floor = ""
    del ref, base
    return verdict(errors, tol_logits, tol_grads, how, floor, paths, x.shape)


# ------------------------------------------------------------------------- overfit one batch
def overfit_one_batch(ctx: PreflightContext, steps: int = OVERFIT_STEPS, drop: float = OVERFIT_DROP,
                      rows: int = OVERFIT_ROWS) -> GateResult:
    """The trained object (without torch.compile), with a fresh optimizer from the run's own factory,
    must cut its loss on one batch by `drop`; its weights are restored afterwards.

    No copy of the model: under FSDP2 a full copy plus AdamW on every rank is what runs out of memory
    exactly when FSDP2 is needed. The weights are snapshotted to host memory (this rank's shard) and
    written back; the gate's optimizer holds moments of the same (sharded) size as training's, whose
    own are not made until its first step. Under DDP/FSDP2 every rank steps until every rank has
    reached the target (each step is a collective); each rank judges its own loss."""
    x, y, mask = peek_batch(ctx, rows)
    raw, model = ctx.raw_model, eager_object(ctx)
    was_training = model.training
    saved = snapshot(raw)
    opt = ctx.optimizer_factory(raw)
    lr = opt.param_groups[0]["lr"]
    clip = ctx.cfg.grad_clip
    losses: list[float] = []
    try:
        model.train()
        with D.eager():  # its rows are another shape: no compile, and no graph training could meet
            for _ in range(steps + 1):
                with ctx.autocast():
                    _, loss = model(x, y, loss_mask=mask)
                lv = float(loss.item())
                losses.append(lv)
                done = not math.isfinite(lv) or min(losses) <= (1.0 - drop) * losses[0]
                # one collective per step on every rank alike: the ranks still short of the target
                pending = ctx.dist.ranks_where(not done, ctx.device) if _dist_enabled(ctx) else ([] if done else [0])
                if not pending or len(losses) > steps:
                    break
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(raw.parameters(), clip)
                opt.step()
    finally:
        del opt
        zero_grads(raw)
        restore(raw, saved)
        model.train(was_training)
    first, last = losses[0], losses[-1]
    finite = all(math.isfinite(v) for v in losses)
    achieved = 1.0 - min(losses) / first if finite and first > 0 else -math.inf
    passed = finite and achieved >= drop
    detail = (f"loss {first:.3f} -> {last:.3f} ({achieved:.0%} lower) in {len(losses) - 1} steps at lr {lr:g} "
              f"on one batch of {x.shape[0]}x{x.shape[1]} tokens")
    if not finite:
        detail = "non-finite loss while overfitting; " + detail
    elif not passed:
        detail = ("the model cannot memorize one batch (broken optimizer, learning rate, loss or gradients?): "
                  + detail)
    return GateResult("overfit_one_batch", passed, value=achieved if finite else math.nan,
                      threshold=f">= {drop:.0%} lower within {steps} steps", detail=detail)


# ---------------------------------------------------------------------------------- throughput
def _sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(ctx: PreflightContext, steps: int = THROUGHPUT_STEPS,
               warmup: int = THROUGHPUT_WARMUP) -> tuple[float, float, int]:
    """Median forward and backward seconds of the trained object on one real micro-batch, and its tokens."""
    x, y, mask = peek_batch(ctx)
    raw = ctx.raw_model
    fwd, bwd = [], []
    for i in range(warmup + steps):
        zero_grads(raw)
        _sync(ctx.device)
        t0 = time.perf_counter()
        with ctx.autocast():
            _, loss = ctx.model(x, y, loss_mask=mask)
        _sync(ctx.device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(ctx.device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        del loss
    zero_grads(raw)
    return statistics.median(fwd), statistics.median(bwd), int(x.numel())


def throughput(ctx: PreflightContext, steps: int = THROUGHPUT_STEPS, warmup: int = THROUGHPUT_WARMUP,
               enforce: bool | None = None, mfu_floor: float = MFU_FLOOR, min_params: int = MFU_MIN_PARAMS,
               max_ratio: float = MAX_BACKWARD_RATIO) -> list[GateResult]:
    """MFU of forward+backward and the backward/forward time ratio; enforced on CUDA, reported on CPU."""
    kind = torch.device(ctx.device).type
    enforce = kind == "cuda" if enforce is None else enforce
    f, b, tokens = time_steps(ctx, steps, warmup)
    note = "" if enforce else f" (measured, not enforced on {kind})"

    if ctx.raw_model.activation_checkpointing:
        max_ratio += RECOMPUTE_ALLOWANCE
    ratio = b / f if f > 0 else math.inf
    ratio_ok = ratio <= max_ratio or not enforce
    rdetail = (f"forward {f * 1e3:.1f} ms, backward {b * 1e3:.1f} ms per {tokens:,} tokens: backward/forward "
               f"{ratio:.2f}{note}")
    if ratio > max_ratio:
        rdetail = f"backward is {ratio:.1f}x slower than forward (a slow or unfused backward kernel?); " + rdetail
    out = [GateResult("throughput.backward_ratio", ratio_ok, value=ratio, threshold=f"<= {max_ratio:g}",
                      detail=rdetail)]

    n_params = count_params(ctx.model_cfg)
    achieved = ctx.flops_per_token * tokens / (f + b)
    applies = n_params >= min_params
    if not ctx.peak_flops:
        out.append(GateResult("throughput.mfu", True, value=None, threshold=f">= {mfu_floor:.0%}",
                              detail=f"{achieved / 1e12:.3g} TFLOP/s achieved; peak FLOP/s unknown for {kind}, "
                                     "MFU not computed"))
        return out
    mfu = achieved / ctx.peak_flops
    ok = mfu >= mfu_floor or not enforce or not applies
    scope = "" if applies else f" (floor applies from {min_params / 1e6:.0f} M params; this model has {n_params / 1e6:.1f} M)"
    mdetail = (f"{achieved / 1e12:.3g} of {ctx.peak_flops / 1e12:.4g} peak TFLOP/s: MFU {mfu:.1%} over forward+"
               f"backward{scope}{note}")
    if mfu < mfu_floor and applies:
        mdetail = f"MFU {mfu:.1%} is below the floor {mfu_floor:.0%}; " + mdetail
    out.append(GateResult("throughput.mfu", ok, value=mfu, threshold=f">= {mfu_floor:.0%}", detail=mdetail))
    return out

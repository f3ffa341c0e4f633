"""Pre-flight gates of an adapter run (training/sft.py --lora-rank): the registry PREFLIGHT with two gates
judged the other way round, on the exact adapted object that trains (compiled, as every gate).

    frozen_parameters  the opposite expectation: every base parameter frozen, every adapter parameter
                       trainable, the run's optimizer holds adapters only, and one optimizer step on a
                       real batch leaves every base parameter bit-identical (and moves the adapters)
    gradient_flow      every adapter parameter gets a finite, nonzero gradient; no base parameter gets one.
                       LoRA starts with B = 0, where dL/dA = 0 by construction: the gate probes with every B
                       set to small random values (restored after), so a cut path to A fails as one to B does
The other gates are PREFLIGHT's: compiled_vs_eager builds its eager reference with the same adapters
(gates.model.reference_model), overfit_one_batch trains the adapters alone with the run's optimizer.
"""

from __future__ import annotations

import torch

from training.gates.context import PreflightContext
from training.gates.gate_registry import PREFLIGHT, Gate
from training.gates.model_gates import peek_batch, restore, snapshot, zero_grads
from training.gates.runtime import gradient_flow_from_grads
from training.runfiles.gate_results import GateResult

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")  # training.model.lora's parameter names (a leaf: no import of it here)
PROBE_STD = 0.02  # the B probe: the scale of the model's own init (init_std), so activations stay ordinary


def split_params(model: torch.nn.Module) -> tuple[list, list]:
    """(adapter, base) named parameters."""
    adapters, base = [], []
    for n, p in model.named_parameters():
        (adapters if n.endswith(ADAPTER_SUFFIXES) else base).append((n, p))
    return adapters, base


def _loss(ctx: PreflightContext, batch: tuple) -> torch.Tensor:
    x, y, mask = batch
    with ctx.autocast():
        _, loss = ctx.model(x, y, loss_mask=mask)
    return loss


def frozen_base(ctx: PreflightContext) -> GateResult:
    """No base parameter trainable, held by the optimizer, or changed by a step; every adapter trainable."""
    raw = ctx.raw_model
    adapters, base = split_params(raw)
    trainable_base = [n for n, p in base if p.requires_grad]
    frozen_adapters = [n for n, p in adapters if not p.requires_grad]
    opt = ctx.optimizer_factory(raw)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    in_optimizer = [n for n, p in base if id(p) in held]
    saved = snapshot(raw)
    try:
        zero_grads(raw)
        _loss(ctx, peek_batch(ctx)).backward()
        opt.step()
        after = dict(zip((n for n, _ in raw.named_parameters()), snapshot(raw), strict=True))
    finally:
        del opt
        zero_grads(raw)
        restore(raw, saved)
    before = dict(zip((n for n, _ in raw.named_parameters()), saved, strict=True))
    changed = [n for n, _ in base if not torch.equal(before[n], after[n])]
    moved = sum(not torch.equal(before[n], after[n]) for n, _ in adapters)
    problems = [f"{label}: {', '.join(names[:6])}" for label, names in (
        ("base parameters trainable", trainable_base), ("adapter parameters frozen", frozen_adapters),
        ("base parameters in the optimizer", in_optimizer), ("base parameters changed by one step", changed))
        if names]
    if not adapters:
        problems.append("no adapter parameter in the model")
    elif not moved:
        problems.append("one optimizer step moved no adapter parameter")
    detail = "; ".join(problems) if problems else (
        f"{len(base)} base parameters frozen and bit-identical after one optimizer step; "
        f"{len(adapters)} adapter parameters trainable ({moved} moved)")
    return GateResult("frozen_parameters", not problems, value=float(len(trainable_base) + len(changed)),
                      threshold="0 base parameters trainable or changed", detail=detail)


def adapter_gradient_flow(ctx: PreflightContext) -> GateResult:
    """One forward/backward with every B probed: each adapter parameter's gradient exists, is finite, nonzero."""
    raw = ctx.raw_model
    adapters, base = split_params(raw)
    saved = snapshot(raw)
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for n, p in adapters:
                if n.endswith(".lora_B"):
                    p.copy_(torch.randn(p.shape, generator=gen).to(p) * PROBE_STD)
        zero_grads(raw)
        _loss(ctx, peek_batch(ctx)).backward()
        result = gradient_flow_from_grads(adapters)
        got_base = [n for n, p in base if p.grad is not None]
    finally:
        zero_grads(raw)
        restore(raw, saved)
    if got_base:
        result.passed = False
        result.detail = f"base parameters got a gradient: {', '.join(got_base[:6])}; " + result.detail
    result.detail += " (every lora_B probed at random, restored after)"
    return result


ADAPTER_PREFLIGHT: dict[str, Gate] = {
    **PREFLIGHT,
    "frozen_parameters": lambda ctx: [frozen_base(ctx)],
    "gradient_flow": lambda ctx: [adapter_gradient_flow(ctx)],
}

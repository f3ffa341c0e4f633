"""compiled_vs_eager's comparison (training.gates.model_gates): relative errors of the trained object's output
and gradients against the eager reference, and, for a bf16/fp16 run, the tolerance derived from the
model's own measured rounding floor instead of one fixed number for every model size."""

from __future__ import annotations

import math

import torch

from training.gates.context import PreflightContext
from training.runfiles.gate_results import GateResult

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # inputs, targets, loss mask (SFT) or None

# bf16/fp16: no fixed number for every size (the rounding error grows with the model: 1b's healthy
# compiled run measured 3.38e-2 against 4e-2 on an H200). The gate measures the model's own floor on the
# real batch, the eager reference against itself with each cast matrix jittered by one unit roundoff
# (FLOOR_JITTER: 2^-8 for bf16's 8-bit significand; FLOOR_SEED fixes the jitter), and allows FLOOR_K
# times it (docs/gates.md, "bf16 tolerances": measured k and margins), never more than FLOOR_MAX (a
# gradient off by a factor 0.5, rel. error 0.5, fails whatever the floor).
FLOOR_PRECISIONS = ("bf16", "fp16")
FLOOR_JITTER = 2.0**-8
FLOOR_SEED = 1
FLOOR_K = 3.0
FLOOR_MAX = (0.1, 0.25)
# The output compared in training mode is the scalar loss, which the jitter can leave unchanged at
# initialization (measured: exactly 0 for one of three seeds of a 2-layer model, logits near uniform),
# while a healthy compiled path reorders its fp32 reductions (inductor on CPU: 1.9e-6; an H200: 1.7e-5
# for 400m). Its floor is therefore at least OUTPUT_MIN_FLOOR, ~128 fp32 roundings of the loss; the
# gradients, which carry the verdict, have no such minimum.
OUTPUT_MIN_FLOOR = 2.0**-16


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero, inf when only b is)."""
    a, b = a.detach().double(), b.detach().double()
    diff, ref = torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()
    if not math.isfinite(diff):
        return math.inf
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref


def compare(out: torch.Tensor, grads: dict[str, torch.Tensor | None], ref_out: torch.Tensor,
            ref_grads: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """{"logits": rel. error of the output (logits, or the loss of a forward that returns none), "<name>.grad":
    rel. error of each gradient}; a gradient missing on one side only is an infinite error."""
    errors = {"logits": rel_error(out, ref_out)}
    for n, g in grads.items():
        r = ref_grads.get(n)
        errors[f"{n}.grad"] = (0.0 if g is r is None else math.inf) if g is None or r is None else rel_error(g, r)
    return errors


def reference_pass(ref: torch.nn.Module, ctx: PreflightContext, batch: Batch, want_logits: bool
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """The eager reference's output (logits, or the loss) and its gradients (taken off the parameters)."""
    x, y, mask = batch
    with ctx.autocast():
        logits, loss = ref(x, y, loss_mask=mask)
    loss.backward()
    out = (logits if want_logits and logits is not None else loss).detach().float()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for p in ref.parameters():
        p.grad = None
    return out, grads


def low_precision_tolerance(ref: torch.nn.Module, ctx: PreflightContext, batch: Batch, want_logits: bool,
                            base: tuple[torch.Tensor, dict]) -> tuple[float, float, float, float]:
    """(logits tolerance, gradients tolerance, logits floor, gradients floor) for a bf16/fp16 run, derived
    from this model's own rounding noise on this batch: the eager reference again with every matrix it
    casts to the compute dtype perturbed by one unit roundoff (a seeded relative jitter of at most
    FLOOR_JITTER), against its unperturbed pass `base`. The floor is the largest such error (over the
    gradients; the logits apart); the tolerance FLOOR_K times it, at most FLOOR_MAX. `ref` is perturbed."""
    gen = torch.Generator(device=ctx.device).manual_seed(FLOOR_SEED)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() >= 2:  # what autocast rounds to bf16 (the norms' vectors compute in fp32)
                p.mul_(1 + FLOOR_JITTER * (2 * torch.rand(p.shape, generator=gen, device=p.device) - 1))
    out, grads = reference_pass(ref, ctx, batch, want_logits)
    errors = compare(out, grads, *base)
    floor_logits = max(errors.pop("logits"), OUTPUT_MIN_FLOOR)
    floor_grads = max(errors.values(), default=0.0)
    tol_l, tol_g = (min(FLOOR_K * f, cap) for f, cap in zip((floor_logits, floor_grads), FLOOR_MAX, strict=True))
    return tol_l, tol_g, floor_logits, floor_grads


def verdict(errors: dict[str, float], tol_logits: float, tol_grads: float, how: str, floor: str,
            paths: list[str], shape: torch.Size) -> GateResult:
    """compiled_vs_eager's result: every error against its tolerance, the worst one named."""
    tol = {k: (tol_logits if k == "logits" else tol_grads) for k in errors}
    worst = max(errors, key=lambda k: errors[k] / tol[k] if tol[k] else math.inf)  # nearest to (or past) its tolerance
    bad = [k for k, e in errors.items() if not e <= tol[k]]
    where = ", ".join(paths) if paths else "plain eager path (nothing compiled or fused)"
    worst_grad = max((k for k in errors if k != "logits"), key=lambda k: errors[k], default="logits")
    detail = (f"{where}: worst {worst} rel. error {errors[worst]:.2e} ({how} {tol[worst]:.3g}) over "
              f"logits + {len(errors) - 1} gradients of a {shape[0]}x{shape[1]} batch (logits at {errors['logits']:.2e}, "
              f"gradients up to {errors[worst_grad]:.2e}){floor}")
    if bad:
        shown = ", ".join(f"{k} {errors[k]:.2e}" for k in sorted(bad, key=lambda k: -errors[k] / max(tol[k], 1e-30))[:6])
        detail = f"{len(bad)} tensors differ from the eager reference: {shown}; " + detail
    return GateResult("compiled_vs_eager", not bad, value=errors[worst],
                      threshold=f"rel. L2 error <= {tol_logits:.3g} (logits), {tol_grads:.3g} (gradients)", detail=detail)

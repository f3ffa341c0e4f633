"""training/gates/model_gates.py on hand-built contexts: a tiny Transformer (or a module whose loss is scripted)
and a stand-in loader, no prepared data. The expectations come from the gates' requirements: a
relative error of exactly 1 when every value is doubled, a loss that halves exactly meets a 50% drop,
a ratio exactly at its limit passes, a frozen parameter is named. These are the fast tests the `gates`
mutation target runs (test_gates.py prepares a corpus and trains)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import training.gates.model_gates as M
from training.gates.context import PreflightContext
from training.model.decoder import ModelConfig, Transformer, count_params

CFG = ModelConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=16)
B, T = 4, 6


class Loader:
    """A training loader stand-in: next_batch advances a position that state_dict/load_state_dict restore."""

    def __init__(self, batch: tuple[torch.Tensor, ...]) -> None:
        self.batch, self.pos, self.asked = batch, 0, []

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def next_batch(self, n: int) -> tuple[torch.Tensor, ...]:
        self.asked.append(n)
        self.pos += 1
        return self.batch


def batch(mask: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    y = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    return (x, y, torch.ones(B, T)) if mask else (x, y)


def ctx_of(model: nn.Module | None = None, raw: nn.Module | None = None, *, lr: float = 1e-2, clip: float = 0.0,
           compile: bool = False, fsdp: bool = False, autocast: Callable | None = None,
           data: tuple[torch.Tensor, ...] | None = None, peak: float | None = None) -> PreflightContext:
    torch.manual_seed(0)
    raw = raw if raw is not None else (model if isinstance(model, Transformer) else Transformer(CFG))
    cfg = SimpleNamespace(batch_size=B, compile=compile, fsdp=fsdp, grad_clip=clip)
    return PreflightContext(model=model if model is not None else raw, raw_model=raw,
                            optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=lr),
                            batches=SimpleNamespace(train=Loader(data or batch())), cfg=cfg, model_cfg=CFG,
                            device=torch.device("cpu"), autocast=autocast or contextlib.nullcontext,
                            dist=SimpleNamespace(enabled=False), flops_per_token=100.0, peak_flops=peak)


class Doubled(nn.Module):
    """The trained object with a planted defect: logits and loss (so every gradient) times 2."""

    def __init__(self, raw: Transformer) -> None:
        super().__init__()
        self.raw = raw

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, loss_mask: torch.Tensor | None = None) -> tuple:
        logits, loss = self.raw(x, y, loss_mask=loss_mask)
        return (None if logits is None else 2 * logits), 2 * loss


# ------------------------------------------------------------------------------------ helpers
def test_rel_error_is_the_relative_l2_norm() -> None:
    b = torch.tensor([3.0, 0.0, 4.0])  # ||b|| = 5
    assert M.rel_error(b + torch.tensor([0.0, 3.0, 0.0]), b) == 3 / 5
    assert M.rel_error(b, b) == 0.0
    assert M.rel_error(torch.zeros(3), torch.zeros(3)) == 0.0  # both zero: equal
    assert M.rel_error(torch.ones(3), torch.zeros(3)) == math.inf  # only the reference is zero
    assert M.rel_error(torch.tensor([math.nan, 0.0, 0.0]), b) == math.inf
    assert M.rel_error(torch.tensor([math.inf, 0.0, 0.0]), b) == math.inf
    assert M.rel_error(torch.tensor([1.0, 0.0]), torch.tensor([math.nan, 0.0])) == math.inf
    # computed in float64: a float32 sum of squares of 1e20 would overflow to inf
    assert M.rel_error(torch.full((4,), 2e20), torch.full((4,), 1e20)) == pytest.approx(1.0)


def test_frozen_parameters_are_named() -> None:
    m = nn.ModuleDict({"a": nn.Linear(2, 2, bias=False), "b": nn.Linear(2, 2, bias=False), "c": nn.Linear(2, 2)})
    r = M.frozen_parameters(m)
    assert (r.name, r.passed, r.value, r.threshold, r.detail) == (
        "frozen_parameters", True, 0.0, "0", "every parameter is trainable")
    m["a"].weight.requires_grad_(False)
    m["c"].bias.requires_grad_(False)
    r = M.frozen_parameters(m)
    assert (r.passed, r.value, r.detail) == (False, 2.0, "frozen by mistake? a.weight, c.bias")


def test_zero_grads_clears_every_gradient() -> None:
    m = nn.Linear(2, 2)
    m(torch.ones(1, 2)).sum().backward()
    M.zero_grads(m)
    assert [p.grad for p in m.parameters()] == [None, None]


def test_peek_batch_reads_the_next_batch_without_consuming_it() -> None:
    x, y, mask = batch(mask=True)
    ctx = ctx_of(data=(x, y, mask))
    loader = ctx.batches.train
    px, py, pm = M.peek_batch(ctx)
    assert loader.pos == 0 and loader.asked == [B]  # the run's own micro-batch size, position restored
    assert torch.equal(px, x) and torch.equal(py, y) and torch.equal(pm, mask)
    px, py, pm = M.peek_batch(ctx, rows=2)
    assert px.shape == py.shape == pm.shape == (2, T) and torch.equal(px, x[:2]) and torch.equal(pm, mask[:2])
    assert M.peek_batch(ctx_of(data=(x, y)))[2] is None  # pretraining batches carry no loss mask
    assert M.peek_batch(ctx_of(data=(x, y)), rows=1)[0].shape == (1, T)


def test_peek_batch_restores_the_loader_when_reading_fails() -> None:
    ctx = ctx_of()

    def boom(n: int) -> tuple:
        ctx.batches.train.pos += 1
        raise RuntimeError("disk")

    ctx.batches.train.next_batch = boom
    with pytest.raises(RuntimeError, match="disk"):
        M.peek_batch(ctx)
    assert ctx.batches.train.pos == 0


def test_precision_is_what_the_matmuls_compute_in() -> None:
    assert M.precision(ctx_of()) == "fp32"
    assert M.autocast_dtype(ctx_of()) == torch.float32
    bf16 = ctx_of(autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert M.precision(bf16) == "bf16" and M.autocast_dtype(bf16) == torch.bfloat16
    half = ctx_of()
    half.raw_model.half()  # fp16 parameters without autocast
    assert M.precision(half) == "fp16"
    assert M.TOLERANCE[M.precision(ctx_of())] == (1e-3, 1e-3)


def test_sharded_local_and_eager_object() -> None:
    m = nn.Linear(2, 2)
    assert not M._sharded(m)
    m.weight.full_tensor = lambda: None  # what an FSDP2 DTensor parameter has
    assert M._sharded(m)
    shard = SimpleNamespace(to_local=lambda: "mine")
    assert M._local(shard) == "mine" and M._local(m.bias) is m.bias
    raw = Transformer(CFG)
    assert M.eager_object(ctx_of(raw)) is raw
    compiled = SimpleNamespace(_orig_mod=raw)  # what torch.compile returns wraps the module here
    assert M.eager_object(ctx_of(compiled, raw)) is raw


def test_reference_model_is_a_fresh_eager_copy_of_the_weights() -> None:
    ctx = ctx_of()
    with torch.no_grad():
        ctx.raw_model.norm.weight.fill_(3.0)
    ref = M.reference_model(ctx)
    assert ref is not ctx.raw_model and type(ref) is Transformer and ref.training
    assert all(torch.equal(v, ctx.raw_model.state_dict()[k]) for k, v in ref.state_dict().items())
    assert ref.norm.weight.data_ptr() != ctx.raw_model.norm.weight.data_ptr()  # not shared storage
    ctx.raw_model.eval()
    assert not M.reference_model(ctx).training
    ctx.raw_model.extra = nn.Linear(2, 2)  # a parameter the reference model lacks
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight', 'extra.bias'\]"):
        M.reference_model(ctx)


def test_snapshot_and_restore_round_trip_on_the_host() -> None:
    m = nn.Linear(2, 2)
    saved = M.snapshot(m)
    assert all(s.device.type == "cpu" and not s.requires_grad for s in saved)
    before = [s.clone() for s in saved]
    with torch.no_grad():
        m.weight.add_(1.0)
    assert torch.equal(saved[0], before[0])  # a copy, not a view
    M.restore(m, saved)
    assert all(torch.equal(p, s) for p, s in zip(m.parameters(), before, strict=True))
    with pytest.raises(ValueError):
        M.restore(m, saved[:1])  # one saved tensor per parameter, no fewer


# ------------------------------------------------------------------------------ nonreference paths
class Custom(nn.Module):  # defined outside training.model.decoder / torch.nn: not the reference path
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_nonreference_paths_name_what_differs_from_plain_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = ctx_of()
    assert M.nonreference_paths(ctx) == []
    ctx.cfg.compile = True
    ctx.raw_model.activation_checkpointing = True
    ctx.raw_model.layers[0].feed_forward.forward = lambda x: x  # a patched forward
    ctx.raw_model.extra = Custom()
    assert M.nonreference_paths(ctx) == ["torch.compile", "activation checkpointing",
                                         f"layers.0.feed_forward ({type(ctx.raw_model.layers[0].feed_forward).__name__})",
                                         "extra (Custom)"]
    monkeypatch.setattr(M, "_dist_enabled", lambda c: True)
    assert M.nonreference_paths(ctx)[2] == "DDP"
    ctx.cfg.fsdp = True
    assert M.nonreference_paths(ctx)[2] == "FSDP2"
    root = ctx_of()
    root.raw_model.forward = lambda *a, **k: None
    monkeypatch.setattr(M, "_dist_enabled", lambda c: False)
    assert M.nonreference_paths(root) == ["model (Transformer)"]


def test_dist_enabled_needs_an_initialized_process_group() -> None:
    ctx = ctx_of()
    assert not M._dist_enabled(ctx)
    ctx.dist.enabled = True  # configured, but no process group in this process
    assert not M._dist_enabled(ctx)


# ------------------------------------------------------------------------------ gradient flow
def test_gradient_flow_passes_a_healthy_model_and_clears_its_gradients() -> None:
    ctx = ctx_of()
    r = M.gradient_flow(ctx)
    assert r.name == "gradient_flow" and r.passed, r.detail
    assert all(p.grad is None for p in ctx.raw_model.parameters())
    assert ctx.batches.train.pos == 0


def test_gradient_flow_fails_a_detached_parameter() -> None:
    raw = Transformer(CFG)

    class Detached(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor, *, loss_mask: torch.Tensor | None = None) -> tuple:
            return torch.func.functional_call(raw, {"norm.weight": raw.norm.weight.detach()}, (x, y),
                                              {"loss_mask": loss_mask})

    r = M.gradient_flow(ctx_of(Detached(), raw))
    assert not r.passed and "norm.weight" in r.detail


# ------------------------------------------------------------------------------ compiled vs eager
def test_compiled_vs_eager_passes_the_same_path_at_zero_error() -> None:
    ctx = ctx_of()
    r = M.compiled_vs_eager(ctx)
    assert (r.name, r.passed, r.value) == ("compiled_vs_eager", True, 0.0)  # eager vs eager: bit-identical
    assert r.threshold == "rel. L2 error <= 0.001 (logits), 0.001 (gradients)"  # the fp32 tolerances
    assert r.detail.startswith("plain eager path (nothing compiled or fused): worst ")
    assert f"logits + {len(list(ctx.raw_model.parameters()))} gradients of a {B}x{T} batch" in r.detail
    assert all(p.grad is None for p in ctx.raw_model.parameters()) and ctx.batches.train.pos == 0


@pytest.mark.parametrize("train", [True, False], ids=["loss (fused, training mode)", "logits (eval mode)"])
def test_compiled_vs_eager_doubled_values_sit_at_relative_error_one(train: bool) -> None:
    # 2v vs v: ||2v - v|| / ||v|| = 1 exactly, for the logits (or the loss) and every gradient
    raw = Transformer(CFG).train(train)
    n = len(list(raw.parameters()))
    at = M.compiled_vs_eager(ctx_of(Doubled(raw), raw), tolerance=(1.0, 1.0))
    assert at.passed and at.value == 1.0, at.detail  # exactly at the tolerance: passes
    assert at.threshold == "rel. L2 error <= 1 (logits), 1 (gradients)"
    under = M.compiled_vs_eager(ctx_of(Doubled(raw), raw), tolerance=(0.5, 1.0))
    assert not under.passed and under.value == 1.0
    assert under.detail.startswith("1 tensors differ from the eager reference: logits 1.00e+00; ")
    assert "worst logits rel. error 1.00e+00 (fp32 tolerance 0.5)" in under.detail
    grads = M.compiled_vs_eager(ctx_of(Doubled(raw), raw), tolerance=(1.0, 0.25))
    assert not grads.passed and grads.value == 1.0
    assert grads.detail.startswith(f"{n} tensors differ from the eager reference: ")
    assert grads.detail.count(".grad 1.00e+00") == 6  # at most six named
    assert "worst " in grads.detail and "(fp32 tolerance 0.25)" in grads.detail
    assert "(logits at 1.00e+00, gradients up to 1.00e+00)" in grads.detail
    assert grads.detail.endswith(f"{n} gradients of a {B}x{T} batch (logits at 1.00e+00, gradients up to 1.00e+00)")


def test_compiled_vs_eager_a_missing_gradient_is_infinitely_wrong() -> None:
    raw = Transformer(CFG)

    class Detached(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor, *, loss_mask: torch.Tensor | None = None) -> tuple:
            return torch.func.functional_call(raw, {"norm.weight": raw.norm.weight.detach()}, (x, y),
                                              {"loss_mask": loss_mask})

    r = M.compiled_vs_eager(ctx_of(Detached(), raw))
    assert not r.passed and r.value == math.inf
    assert r.detail.startswith("1 tensors differ from the eager reference: norm.weight.grad inf; ")


def test_compiled_vs_eager_skips_frozen_and_equal_missing_gradients() -> None:
    raw = Transformer(CFG)
    raw.layers[0].attention.wq.weight.requires_grad_(False)  # frozen: neither side has a gradient
    r = M.compiled_vs_eager(ctx_of(raw))
    assert r.passed and r.value == 0.0
    assert f"logits + {len(list(raw.parameters())) - 1} gradients" in r.detail


def test_compiled_vs_eager_names_the_nonreference_paths() -> None:
    ctx = ctx_of(compile=True)
    assert M.compiled_vs_eager(ctx).detail.startswith("torch.compile: worst ")


def test_compiled_vs_eager_tolerance_is_the_precisions() -> None:
    # bf16 autocast: no fixed number, FLOOR_K x this model's measured floor (#48; tests/test_gpu_path.py)
    ctx = ctx_of(autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    r = M.compiled_vs_eager(ctx)
    assert r.passed and f"bf16 tolerance = {M.FLOOR_K:g} x this model's floor" in r.detail, r.detail
    assert r.threshold != "rel. L2 error <= 0.02 (logits), 0.04 (gradients)"


# ------------------------------------------------------------------------------ overfit
class Scripted(nn.Module):
    """A 'model' whose training losses are given in order (each with a gradient, so optimizers step)."""

    def __init__(self, losses: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.losses: Iterator[float] = iter(losses)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, loss_mask: torch.Tensor | None = None) -> tuple:
        return None, self.w.sum() * 0 + next(self.losses)


def scripted(losses: list[float]) -> PreflightContext:
    m = Scripted(losses)
    return ctx_of(m, m)


def test_overfit_a_loss_that_halves_exactly_meets_a_50_percent_drop() -> None:
    r = M.overfit_one_batch(scripted([1.0, 0.6, 0.5, 9.0]))
    assert (r.name, r.passed, r.value) == ("overfit_one_batch", True, 0.5)
    assert r.threshold == ">= 50% lower within 100 steps"
    assert r.detail == f"loss 1.000 -> 0.500 (50% lower) in 2 steps at lr 0.01 on one batch of 2x{T} tokens"


def test_overfit_stops_at_its_step_budget() -> None:
    # losses exactly representable in float32 (the loss is read back with .item())
    r = M.overfit_one_batch(scripted([1.0, 0.75, 0.625, 0.515625, 0.5]), steps=3)
    assert not r.passed and r.value == 1 - 0.515625
    assert r.detail == ("the model cannot memorize one batch (broken optimizer, learning rate, loss or gradients?): "
                        f"loss 1.000 -> 0.516 (48% lower) in 3 steps at lr 0.01 on one batch of 2x{T} tokens")
    assert r.threshold == ">= 50% lower within 3 steps"
    # the best loss counts, not the last
    r = M.overfit_one_batch(scripted([1.0, 0.625, 0.75]), steps=2)
    assert not r.passed and r.value == 0.375 and "loss 1.000 -> 0.750 (38% lower)" in r.detail
    assert M.overfit_one_batch(scripted([1.0, 0.875, 0.25]), steps=2, drop=0.75).passed


def test_overfit_rows_and_drop_are_the_callers() -> None:
    r = M.overfit_one_batch(scripted([1.0, 0.75]), drop=0.25, rows=3)
    assert r.passed and r.threshold == ">= 25% lower within 100 steps" and f"one batch of 3x{T} tokens" in r.detail
    r = M.overfit_one_batch(scripted([1.0]), steps=0, drop=0.0)  # a zero drop is met before any step
    assert r.passed and r.value == 0.0 and "in 0 steps" in r.detail


def test_overfit_non_finite_or_zero_loss_fails() -> None:
    r = M.overfit_one_batch(scripted([1.0, math.nan, 0.0]))
    assert not r.passed and math.isnan(r.value)
    assert r.detail.startswith("non-finite loss while overfitting; loss 1.000 -> nan")
    assert "in 1 steps" in r.detail  # stopped at the NaN
    r = M.overfit_one_batch(scripted([math.inf, 1.0]))
    assert not r.passed and math.isnan(r.value) and "in 0 steps" in r.detail
    r = M.overfit_one_batch(scripted([0.0, 0.0]), steps=1)  # nothing to drop from
    assert not r.passed and r.value == -math.inf


def test_overfit_trains_the_real_model_and_restores_it() -> None:
    ctx = ctx_of()
    before = {k: v.clone() for k, v in ctx.raw_model.state_dict().items()}
    ctx.raw_model.eval()
    r = M.overfit_one_batch(ctx)
    assert r.passed, r.detail
    assert all(torch.equal(before[k], v) for k, v in ctx.raw_model.state_dict().items())
    assert all(p.grad is None for p in ctx.raw_model.parameters()) and not ctx.raw_model.training
    assert ctx.batches.train.pos == 0


def test_overfit_with_a_zero_learning_rate_fails() -> None:
    r = M.overfit_one_batch(ctx_of(lr=0.0), steps=5)
    assert not r.passed and r.detail.startswith("the model cannot memorize one batch")


def test_overfit_clips_gradients_at_the_runs_grad_clip() -> None:
    # plain SGD: a clip of 1e-12 leaves steps of ~1e-12, so the loss cannot halve; without clipping it does
    def sgd(clip: float) -> PreflightContext:
        c = ctx_of(clip=clip)
        c.optimizer_factory = lambda m: torch.optim.SGD(m.parameters(), lr=3.0)
        return c

    assert M.overfit_one_batch(sgd(0.0), steps=30).passed
    assert not M.overfit_one_batch(sgd(1e-12), steps=30).passed


# ------------------------------------------------------------------------------ throughput
def test_time_steps_reports_medians_after_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    # per call: t0, t1 (forward done), t2 (backward done); the first (warmup) call is not timed
    marks = [0, 100, 300,  10, 11, 14,  20, 25, 26,  30, 32, 39]
    clock = iter(marks)
    monkeypatch.setattr(M, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    ctx = ctx_of()
    f, b, tokens = M.time_steps(ctx, steps=3, warmup=1)
    assert (f, b, tokens) == (2, 3, B * T)  # medians of (1, 5, 2) and (3, 1, 7)
    assert all(p.grad is None for p in ctx.raw_model.parameters()) and ctx.batches.train.pos == 0


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict]:
    def run(f: float, b: float, *, tokens: int = 1000, peak: float | None = None, ckpt: bool = False,
            **kw: object) -> dict:
        ctx = ctx_of(peak=peak)
        ctx.raw_model.activation_checkpointing = ckpt
        monkeypatch.setattr(M, "time_steps", lambda c, steps, warmup: (f, b, tokens))
        return {r.name: r for r in M.throughput(ctx, **kw)}
    return run


def test_backward_ratio_exactly_at_the_limit_passes_where_enforced(timed: Callable[..., dict]) -> None:
    r = timed(0.1, 0.35, enforce=True)["throughput.backward_ratio"]  # 3.5 = MAX_BACKWARD_RATIO
    assert r.passed and r.value == pytest.approx(3.5) and r.threshold == "<= 3.5"
    assert r.detail == "forward 100.0 ms, backward 350.0 ms per 1,000 tokens: backward/forward 3.50"
    r = timed(0.1, 0.36, enforce=True)["throughput.backward_ratio"]
    assert not r.passed
    assert r.detail == ("backward is 3.6x slower than forward (a slow or unfused backward kernel?); forward 100.0 ms, "
                        "backward 360.0 ms per 1,000 tokens: backward/forward 3.60")
    r = timed(0.1, 0.36)["throughput.backward_ratio"]  # on CPU: measured, not enforced
    assert r.passed and r.detail.endswith("backward/forward 3.60 (measured, not enforced on cpu)")
    assert timed(0.0, 0.1, enforce=True)["throughput.backward_ratio"].value == math.inf


def test_activation_checkpointing_allows_one_more_forward(timed: Callable[..., dict]) -> None:
    r = timed(0.1, 0.45, ckpt=True, enforce=True)["throughput.backward_ratio"]
    assert r.passed and r.threshold == "<= 4.5"
    assert not timed(0.1, 0.46, ckpt=True, enforce=True)["throughput.backward_ratio"].passed
    assert not timed(0.1, 0.45, enforce=True, max_ratio=4.0)["throughput.backward_ratio"].passed


def test_mfu_unknown_peak_is_reported_not_judged(timed: Callable[..., dict]) -> None:
    r = timed(0.5, 0.5, tokens=10_000)["throughput.mfu"]  # 100 FLOP/token * 1e4 tokens / 1 s = 1e6 FLOP/s
    assert (r.passed, r.value, r.threshold) == (True, None, ">= 25%")
    assert r.detail == "1e-06 TFLOP/s achieved; peak FLOP/s unknown for cpu, MFU not computed"


def test_mfu_exactly_at_the_floor_passes(timed: Callable[..., dict]) -> None:
    n = count_params(CFG)
    # achieved = 100 * 10_000 / 1 s = 1e6 FLOP/s; a peak of 4e6 makes MFU exactly 25%
    r = timed(0.5, 0.5, tokens=10_000, peak=4e6, enforce=True, min_params=n)["throughput.mfu"]
    assert r.passed and r.value == 0.25 and r.threshold == ">= 25%"
    assert r.detail == "1e-06 of 4e-06 peak TFLOP/s: MFU 25.0% over forward+backward"
    r = timed(0.5, 0.5, tokens=10_000, peak=5e6, enforce=True, min_params=n)["throughput.mfu"]
    assert not r.passed and r.value == pytest.approx(0.2)
    assert r.detail == "MFU 20.0% is below the floor 25%; 1e-06 of 5e-06 peak TFLOP/s: MFU 20.0% over forward+backward"
    # the floor applies from min_params: one parameter short, reported only
    r = timed(0.5, 0.5, tokens=10_000, peak=5e6, enforce=True, min_params=n + 1)["throughput.mfu"]
    assert r.passed and r.detail.endswith(
        f"(floor applies from {(n + 1) / 1e6:.0f} M params; this model has {n / 1e6:.1f} M)")
    r = timed(0.5, 0.5, tokens=10_000, peak=5e6, min_params=n)["throughput.mfu"]  # not enforced on CPU
    assert r.passed and r.detail.endswith("(measured, not enforced on cpu)")
    r = timed(0.5, 0.5, tokens=10_000, peak=5e6, enforce=True, min_params=n, mfu_floor=0.2)["throughput.mfu"]
    assert r.passed and r.threshold == ">= 20%"


# ------------------------------------------------------------------------------ what reaches the model
class Recording(nn.Module):
    """The trained object, recording the loss mask of every call (SFT batches carry one)."""

    def __init__(self, raw: Transformer) -> None:
        super().__init__()
        self.raw, self.masks = raw, []

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, loss_mask: torch.Tensor | None = None) -> tuple:
        self.masks.append(loss_mask)
        return self.raw(x, y, loss_mask=loss_mask)


def sft_batch() -> tuple[torch.Tensor, ...]:
    x, y = batch()
    mask = torch.ones(B, T)
    mask[:, : T // 2] = 0  # the prompt half carries no loss
    return x, y, mask


@pytest.mark.parametrize("gate", ["gradient_flow", "time_steps", "overfit_one_batch", "compiled_vs_eager"])
def test_every_gate_runs_the_batch_with_its_loss_mask(gate: str) -> None:
    raw = Transformer(CFG)
    rec = Recording(raw)
    data = sft_batch()
    getattr(M, gate)(ctx_of(rec, raw, data=data))
    rows = 2 if gate == "overfit_one_batch" else B
    assert rec.masks and all(m is not None and torch.equal(m, data[2][:rows]) for m in rec.masks)


def test_compiled_vs_eager_masks_the_reference_too() -> None:
    # the same masked loss on both sides: equal; a reference without the mask would differ (training mode
    # compares the loss)
    raw = Transformer(CFG).train()
    r = M.compiled_vs_eager(ctx_of(raw, raw, data=sft_batch()))
    assert r.passed and r.value == 0.0, r.detail


def test_compiled_vs_eager_takes_the_rows_asked_for() -> None:
    assert "of a 2x6 batch" in M.compiled_vs_eager(ctx_of(), rows=2).detail


# ------------------------------------------------------------------------------ distributed paths
@pytest.fixture
def dist(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Pretend a process group is up: record what each gate broadcasts (rank 0's tensors kept)."""
    seen: list[tuple] = []
    monkeypatch.setattr(M, "_dist_enabled", lambda c: True)
    monkeypatch.setattr(M, "_broadcast", lambda c, t: seen.append((c, t)) or t)
    return seen


def test_peek_batch_broadcasts_rank_zeros_batch_only_when_asked(dist: list[tuple]) -> None:
    x, y, mask = sft_batch()
    ctx = ctx_of(data=(x, y, mask))
    M.peek_batch(ctx)
    assert dist == []  # each rank's own batch by default
    M.peek_batch(ctx, same_on_all_ranks=True)
    assert [c for c, _ in dist] == [ctx] * 3
    assert [t.tolist() for _, t in dist] == [x.tolist(), y.tolist(), mask.tolist()]


def test_compiled_vs_eager_compares_the_same_rows_on_every_rank(dist: list[tuple]) -> None:
    M.compiled_vs_eager(ctx_of())
    assert len(dist) == 3 and dist[2][1] is None  # x, y and the (absent) mask: rank 0's


def test_overfit_under_ddp_steps_until_every_rank_is_done(dist: list[tuple]) -> None:
    ctx = scripted([1.0, 0.5, 0.25, 0.125])
    asked: list[tuple] = []

    def ranks_where(short: bool, device: torch.device) -> list[int]:
        asked.append((short, device))
        return [1] if len(asked) < 3 else []  # rank 1 is still short of its target for two steps

    ctx.dist.ranks_where = ranks_where
    r = M.overfit_one_batch(ctx)
    # this rank is short before its first step only, yet steps (collectively) until every rank is done
    assert r.passed and asked == [(True, ctx.device), (False, ctx.device), (False, ctx.device)]
    assert "in 2 steps" in r.detail and "-> 0.250" in r.detail


@pytest.fixture
def world_of_one() -> Iterator[None]:
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        tdist.destroy_process_group()


def test_broadcast_in_a_world_of_one_returns_rank_zeros_tensor(world_of_one: None) -> None:
    ctx = ctx_of()
    ctx.dist.enabled = True
    assert M._dist_enabled(ctx)
    t = torch.arange(6).reshape(2, 3)
    out = M._broadcast(ctx, t)
    assert torch.equal(out, torch.arange(6).reshape(2, 3)) and M._broadcast(ctx, None) is None


def test_broadcast_gives_a_rank_rank_zeros_batch_of_another_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    # what a rank other than 0 sees: rank 0 sends its shape, then its tensor (SFT batches are padded per
    # batch, so shapes differ); a stand-in collective copies rank 0's values into the given buffer
    rank0 = torch.arange(12).reshape(3, 4)
    sent = [torch.tensor([3, 4]), rank0]

    def broadcast(t: torch.Tensor, src: int) -> None:
        assert src == 0
        t.copy_(sent.pop(0))

    monkeypatch.setattr(M.tdist, "broadcast", broadcast)
    out = M._broadcast(ctx_of(), torch.zeros(2, 4, dtype=torch.int64))
    assert out.shape == (3, 4) and out.dtype == torch.int64 and torch.equal(out, rank0)


def test_full_weights_of_a_sharded_model_are_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = ctx_of()
    ctx.raw_model.norm.weight.full_tensor = lambda: None  # an FSDP2 parameter
    monkeypatch.setattr(M.D, "full_model_state", lambda m: {"from": m})
    assert M._full_weights(ctx) == {"from": ctx.model}


# ------------------------------------------------------------------------------ precision on CUDA
@pytest.fixture
def tf32() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_fp32_on_cuda_with_tf32_matmuls_is_tf32(tf32: None) -> None:
    # no CUDA needed: the precision is read from the device type, the dtype and the TF32 switch
    cuda = ctx_of()
    cuda.device = torch.device("cuda")
    assert M.precision(cuda) == "tf32"
    assert M.precision(ctx_of()) == "fp32"  # TF32 is a CUDA matmul mode: not on the CPU
    cuda.raw_model.half()
    assert M.precision(cuda) == "fp16"
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda.raw_model.float()
    assert M.precision(cuda) == "fp32"


def test_every_precision_has_a_tolerance() -> None:
    odd = ctx_of()
    odd.raw_model.double()  # a dtype with no class of its own still gets one of the four tolerances
    assert M.precision(odd) in M.TOLERANCE


def test_sync_waits_for_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(M.torch.cuda, "synchronize", lambda d: synced.append(d))
    M._sync(torch.device("cpu"))
    M._sync(torch.device("cuda:1"))
    assert synced == [torch.device("cuda:1")]


def test_peek_batch_moves_the_batch_to_the_device() -> None:
    ctx = ctx_of(data=sft_batch())
    ctx.device = torch.device("meta")  # another device without an accelerator
    assert [t.device.type for t in M.peek_batch(ctx)] == ["meta"] * 3


# ------------------------------------------------------------------------------ detail of a failure
def test_compiled_vs_eager_orders_failures_by_how_far_past_their_tolerance() -> None:
    raw = Transformer(CFG).eval()

    class LogitsTimesFour(nn.Module):  # logits x4 (rel. error 3), loss (so gradients) untouched
        def forward(self, x: torch.Tensor, y: torch.Tensor, *, loss_mask: torch.Tensor | None = None) -> tuple:
            logits, loss = raw(x, y, loss_mask=loss_mask)
            return 4 * logits, loss

    # the worst gradient is neither the first nor the last by name; the order is by how far past, not by name
    raw.norm.weight.register_hook(lambda g: 3 * g)  # rel. error 2
    raw.layers[0].attention.wq.weight.register_hook(lambda g: 2 * g)  # rel. error 1
    ctx = ctx_of(LogitsTimesFour(), raw, compile=True)
    ctx.raw_model.activation_checkpointing = True
    r = M.compiled_vs_eager(ctx, tolerance=(0.1, 0.5))  # ratios: logits 30, norm 4, wq 2
    assert not r.passed and r.value == pytest.approx(3.0)  # ||4v - v|| / ||v||, measured 3.0000000000000018
    assert r.detail.startswith("3 tensors differ from the eager reference: logits 3.00e+00, "
                               "norm.weight.grad 2.00e+00, layers.0.attention.wq.weight.grad 1.00e+00; "
                               "torch.compile, activation checkpointing: worst logits rel. error 3.00e+00 "
                               "(fp32 tolerance 0.1)")
    assert r.detail.endswith("(logits at 3.00e+00, gradients up to 2.00e+00)")
    r = M.compiled_vs_eager(ctx_of(raw, raw), tolerance=(0.1, 0.5))  # gradients only
    assert r.detail.endswith("(logits at 0.00e+00, gradients up to 2.00e+00)")


def test_a_reference_gradient_missing_where_the_trained_one_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    build = M.reference_model

    def no_norm_grad(ctx: PreflightContext) -> Transformer:
        ref = build(ctx)
        ref.norm.weight.requires_grad_(False)
        return ref

    monkeypatch.setattr(M, "reference_model", no_norm_grad)
    r = M.compiled_vs_eager(ctx_of())
    assert not r.passed and r.value == math.inf and "norm.weight.grad inf" in r.detail
    raw = Transformer(CFG)

    class Detached(nn.Module):  # neither side has norm.weight's gradient: nothing to compare, no error
        def forward(self, x: torch.Tensor, y: torch.Tensor, *, loss_mask: torch.Tensor | None = None) -> tuple:
            return torch.func.functional_call(raw, {"norm.weight": raw.norm.weight.detach()}, (x, y),
                                              {"loss_mask": loss_mask})

    r = M.compiled_vs_eager(ctx_of(Detached(), raw))
    assert r.passed and r.value == 0.0, r.detail


def test_reference_model_names_at_most_four_mismatched_parameters() -> None:
    two = ModelConfig(vocab_size=32, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=16)
    ctx = ctx_of(Transformer(two))  # the trained object has a second layer the reference lacks
    with pytest.raises(ValueError) as e:
        M.reference_model(ctx)
    assert str(e.value).count("'layers.1.") == 4 and "missing []" in str(e.value)
    ctx = ctx_of()
    ctx.model_cfg = two  # the reference has a layer the trained object lacks
    with pytest.raises(ValueError) as e:
        M.reference_model(ctx)
    assert str(e.value).count("'layers.1.") == 4 and "unexpected []" in str(e.value)


# ------------------------------------------------------------------------------ throughput detail
def test_throughput_defaults_enforce_on_cuda_and_pass_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(M, "time_steps", lambda c, steps, warmup: calls.append((c, steps, warmup)) or (0.25, 0.875, 10))
    ctx = ctx_of()
    ctx.device = torch.device("cuda")
    r = {g.name: g for g in M.throughput(ctx)}["throughput.backward_ratio"]
    assert calls == [(ctx, M.THROUGHPUT_STEPS, M.THROUGHPUT_WARMUP)] and (M.THROUGHPUT_STEPS, M.THROUGHPUT_WARMUP) == (3, 1)
    assert r.passed and r.value == 3.5  # exactly the limit, enforced on CUDA: passes, no warning
    assert r.detail == "forward 250.0 ms, backward 875.0 ms per 10 tokens: backward/forward 3.50"
    monkeypatch.setattr(M, "time_steps", lambda c, steps, warmup: calls.append((c, steps, warmup)) or (0.25, 0.9, 10))
    assert not {g.name: g for g in M.throughput(ctx, steps=5, warmup=2)}["throughput.backward_ratio"].passed
    assert calls[-1] == (ctx, 5, 2)


def test_mfu_arithmetic_and_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    # 100 FLOP/token * 27.5e9 tokens / (1 s + 1 s) = 1.375e12 FLOP/s: shown as 1.38 (a tie, rounded to even)
    monkeypatch.setattr(M, "time_steps", lambda c, steps, warmup: (1.0, 1.0, 27_500_000_000))
    monkeypatch.setattr(M, "count_params", lambda cfg: 750_000)
    r = {g.name: g for g in M.throughput(ctx_of())}["throughput.mfu"]
    assert r.detail == "1.38 TFLOP/s achieved; peak FLOP/s unknown for cpu, MFU not computed"
    # a peak of 1.1875e12 shows as 1.188 (a tie at 4 digits, rounded to even)
    r = {g.name: g for g in M.throughput(ctx_of(peak=1.1875e12), min_params=3_500_000)}["throughput.mfu"]
    assert r.value == pytest.approx(1.375e12 / 1.1875e12)
    assert r.detail == ("1.38 of 1.188 peak TFLOP/s: MFU 115.8% over forward+backward (floor applies from 4 M params; "
                        "this model has 0.8 M) (measured, not enforced on cpu)")

"""The per-step runtime gates of training.gates.runtime on hand-built inputs, each expectation from
the definition, not from the code: the loss-spike z-score over a rolling window, the non-finite
diagnostic (nonfinite.json), clipping that leaves a NaN visible, the index of the first non-finite
gradient. test_gates.py and test_hot_path.py reach these through training runs in subprocesses,
which a mutation run cannot see; these run in-process, in milliseconds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_gradient_flow_arbiter import param  # a parameter holding the given gradient

from training.gates.runtime import RuntimeMonitor, clip_grad_norm_finite, first_nonfinite_index, full_grad

NAN, INF = float("nan"), float("inf")


class Shard:
    """A distributed gradient's stand-in: the whole tensor and this rank's local shard."""

    def __init__(self, whole: list, local: list):
        self.whole, self.local = torch.tensor(whole), torch.tensor(local)

    def full_tensor(self) -> torch.Tensor:
        return self.whole

    def to_local(self) -> torch.Tensor:
        return self.local


# ------------------------------------------------------------------------------------- full_grad
def test_a_sharded_gradient_is_gathered_and_a_plain_one_is_itself() -> None:
    s = Shard([1.0, 2.0, 3.0], [1.0])
    assert full_grad(s) is s.whole
    g = torch.tensor([4.0])
    assert full_grad(g) is g


# --------------------------------------------------------------------------------- loss spikes
def monitor(window: int, z: float = 3.0) -> RuntimeMonitor:
    return RuntimeMonitor(SimpleNamespace(spike_window=window, spike_zscore=z))


@pytest.mark.parametrize(("window", "needed"), [(20, 10), (21, 10), (30, 15)])
def test_no_z_score_before_max_of_ten_and_half_the_window(window: int, needed: int) -> None:
    """MIN_SPIKE_HISTORY = 10 steps, or half the window (rounded down) if more."""
    m = monitor(window)
    for i in range(needed - 1):
        m.observe(i, 1.0 + i % 2)
    assert m.zscore(2.0) is None
    m.observe(needed - 1, 1.0)
    assert m.zscore(2.0) is not None


def test_z_is_the_distance_from_the_window_mean_in_population_standard_deviations() -> None:
    m = monitor(10)
    m.history = [1.0, 3.0] * 5  # mean 2, population standard deviation 1
    assert m.zscore(5.0) == 3.0 and m.zscore(1.5) == -0.5
    m.history = [2.0] * 10  # flat: the deviation is floored at 1e-12, so any rise is a spike
    assert m.zscore(3.0) == pytest.approx(1e12)


def test_a_spike_is_z_above_the_threshold_rounded_to_two_decimals() -> None:
    m = monitor(10, z=3.0)
    m.history = [1.0, 3.0] * 5
    assert m.observe(11, 5.0) is None and m.spikes == []  # z == 3.0 exactly: not above the threshold
    m.history = [1.0, 3.0] * 5
    assert m.observe(12, 2.0 + 3.14159) == 3.14 and m.spikes == [(12, 3.14)]
    assert m.history == [3.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 2.0 + 3.14159]  # the window rolls


# ---------------------------------------------------------------------------- nonfinite.json
def test_the_diagnostic_names_the_first_nonfinite_gradient_scanning_past_missing_ones() -> None:
    named = [("frozen.weight", param(None, trainable=False)), ("a.weight", param(None)),
             ("b.weight", param([1.0, 2.0])), ("c.weight", param([NAN, 1.0])), ("d.weight", param([INF]))]
    d = RuntimeMonitor.nonfinite_diagnostic(7, NAN, INF, named, {"shard": 1, "offset": 64})
    assert d == {"step": 7, "loss": "nan", "grad_norm": "inf", "first_nonfinite_param": "c.weight",
                 "data_position": {"shard": 1, "offset": 64},
                 "detail": "loss=nan, grad_norm=inf, first non-finite gradient in c.weight"}


def test_the_diagnostic_reads_this_ranks_shard_of_a_distributed_gradient() -> None:
    named = [("a.weight", SimpleNamespace(requires_grad=True, grad=Shard([1.0, 1.0], [NAN])))]
    assert RuntimeMonitor.nonfinite_diagnostic(1, NAN, NAN, named, {})["first_nonfinite_param"] == "a.weight"


def test_the_diagnostic_without_a_culprit_says_only_loss_and_norm() -> None:
    d = RuntimeMonitor.nonfinite_diagnostic(3, NAN, 1.5, [("a.weight", param([1.0]))], {})
    assert d["first_nonfinite_param"] is None and d["detail"] == "loss=nan, grad_norm=1.5"


@pytest.mark.parametrize(("index", "name"), [(0, "a.weight"), (1, "b.weight"), (2, None), (-1, None), (5, None)])
def test_a_given_index_counts_trainable_parameters_only(index: int, name: str | None) -> None:
    """first_index: the position among trainable parameters (first_nonfinite_index); -1 or out of range: none."""
    named = [("frozen.weight", param(None, trainable=False)), ("a.weight", param([1.0])), ("b.weight", param([1.0]))]
    d = RuntimeMonitor.nonfinite_diagnostic(2, NAN, NAN, named, {}, first_index=index)
    assert d["first_nonfinite_param"] == name
    assert d["detail"] == "loss=nan, grad_norm=nan" + (f", first non-finite gradient in {name}" if name else "")


# -------------------------------------------------------------------------------------- clipping
def test_clipping_scales_to_max_norm_and_returns_the_norm_before() -> None:
    p, q = param([3.0, 0.0]), param([0.0, 4.0])  # total norm 5
    assert float(clip_grad_norm_finite([p, q], 1.0)) == pytest.approx(5.0)
    assert torch.allclose(torch.cat([p.grad, q.grad]), torch.tensor([0.6, 0.0, 0.0, 0.8]), atol=1e-5)
    p = param([3.0, 4.0])
    clip_grad_norm_finite([p], 0.5)
    assert torch.allclose(p.grad, torch.tensor([0.3, 0.4]), atol=1e-5)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, 10.0])
def test_no_clipping_at_max_norm_zero_or_below_or_under_the_limit(max_norm: float) -> None:
    p = param([3.0, 4.0])
    assert float(clip_grad_norm_finite([p], max_norm)) == pytest.approx(5.0)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0]))


def test_a_nonfinite_norm_leaves_every_gradient_untouched() -> None:
    p, q = param([NAN, 1.0]), param([3.0, 4.0])
    assert math.isnan(float(clip_grad_norm_finite([p, q], 1.0)))
    assert torch.equal(q.grad, torch.tensor([3.0, 4.0]))  # exactly: not scaled by NaN, nor by anything


def test_clipping_on_torch_before_2_6_is_clip_grad_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch < 2.6 has no get_total_norm (pyproject: torch >= 2.5): plain clip_grad_norm_."""
    monkeypatch.delattr(torch.nn.utils, "get_total_norm")
    p = param([3.0, 4.0])
    assert float(clip_grad_norm_finite([p, param(None, trainable=False)], 1.0)) == pytest.approx(5.0)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]), atol=1e-5)


def test_per_gradient_norms_are_handed_out_for_one_device_and_dtype() -> None:
    out: list[torch.Tensor] = []
    total = clip_grad_norm_finite([param([3.0, 4.0]), param([0.0, 12.0]), param(None)], 0.0, norms_out=out)
    assert float(total) == pytest.approx(13.0)  # sqrt(5² + 12²)
    assert len(out) == 1 and out[0].dtype == torch.float32 and torch.allclose(out[0], torch.tensor([5.0, 12.0]))
    out = []
    clip_grad_norm_finite([param([3.0, 4.0])], 0.0, norms_out=out)  # a single gradient
    assert len(out) == 1 and torch.allclose(out[0], torch.tensor([5.0]))


def test_no_per_gradient_norms_for_mixed_dtypes_or_when_not_asked() -> None:
    out: list[torch.Tensor] = []
    p, q = param([3.0, 4.0]), param([0.0, 12.0])
    q.data, q.grad = q.data.double(), q.grad.double()
    assert float(clip_grad_norm_finite([p, q], 0.0, norms_out=out)) == pytest.approx(13.0)
    assert out == []
    assert float(clip_grad_norm_finite([param([3.0, 4.0]), param([0.0, 12.0])], 0.0)) == pytest.approx(13.0)


# --------------------------------------------------------------------------- first non-finite index
def index(named: list, norms: torch.Tensor | None = None) -> int:
    r = first_nonfinite_index(named, norms)
    assert isinstance(r, torch.Tensor) and r.dim() == 0
    return int(r)


def test_the_first_nonfinite_gradient_by_position_among_trainable_parameters() -> None:
    assert index([("a", param([1.0])), ("b", param([NAN])), ("c", param([INF]))]) == 1
    assert index([("a", param([1.0])), ("b", param([2.0, 0.0]))]) == -1
    assert index([("a", param([INF])), ("b", param([NAN]))]) == 0
    # frozen parameters are not counted; one without a gradient is counted but never the culprit
    named = [("frozen", param(None, trainable=False)), ("a", param(None)), ("b", param([1.0])), ("c", param([NAN]))]
    assert index(named) == 2
    assert index([("a", param(None)), ("b", param(None))]) == -1  # no gradient at all: none


def test_given_norms_are_trusted_when_one_per_gradient_and_ignored_otherwise() -> None:
    named = [("a", param(None)), ("b", param([1.0])), ("c", param([2.0]))]
    assert index(named, torch.tensor([1.0, INF])) == 2  # the gradients are not read again
    assert index(named, torch.tensor([NAN, 1.0, 1.0])) == -1  # three norms for two gradients: recomputed


def test_the_index_reads_this_ranks_shard_of_a_distributed_gradient() -> None:
    named = [("a", SimpleNamespace(requires_grad=True, grad=Shard([1.0], [1.0]))),
             ("b", SimpleNamespace(requires_grad=True, grad=Shard([1.0], [NAN])))]
    assert index(named) == 1


def test_the_index_is_computed_on_the_gradients_device_not_the_default_one() -> None:
    """On a GPU run the gradients sit on the accelerator, whatever torch's default device: the indices
    must be made where the gradients are. Here the default is 'meta' and the gradients are on the CPU."""
    every = [("a", param([1.0])), ("b", param([NAN]))]
    some = [("a", param(None)), ("b", param([1.0])), ("c", param([NAN]))]
    with torch.device("meta"):
        assert index(every) == 1 and index(some) == 2

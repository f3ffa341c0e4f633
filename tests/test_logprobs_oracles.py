"""training/model/logprobs.py, the one KL every comparison uses (parity, evaluation, the ONNX checks), on values
written out from the definitions: log p_i = x_i - log sum_j exp x_j; KL(p || q) = sum_i p_i log(p_i / q_i),
in nats, per row. These are the fast tests the `logprobs` mutation target runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from training.model.logprobs import kl_rows, log_softmax, token_logprobs


def test_log_softmax_of_a_hand_example() -> None:
    got = log_softmax(np.array([0.0, math.log(3.0)]))  # p = (1/4, 3/4)
    assert got.dtype == np.float64
    assert got == pytest.approx([math.log(0.25), math.log(0.75)], abs=1e-15)


def test_log_softmax_is_exact_for_logits_whose_exp_overflows() -> None:
    # exp(1000) overflows float64: only the max-shift keeps it finite; float32 input is computed in float64
    got = log_softmax(np.array([[1000.0, 1000.0 + math.log(3.0)]], dtype=np.float32))
    assert got.dtype == np.float64 and np.isfinite(got).all()
    assert got[0] == pytest.approx([math.log(0.25), math.log(0.75)], abs=1e-4)  # 1000 + ln 3 rounded to fp32
    lo = log_softmax(np.array([-1000.0, -1000.0]))
    assert lo == pytest.approx([math.log(0.5)] * 2, abs=1e-15)


def test_log_softmax_works_on_the_last_axis_of_every_row() -> None:
    x = np.array([[[0.0, 0.0], [0.0, math.log(3.0)]], [[5.0, 5.0], [1.0, 1.0]]])
    got = log_softmax(x)
    assert got.shape == (2, 2, 2)
    assert np.exp(got).sum(-1) == pytest.approx(np.ones((2, 2)), abs=1e-15)
    assert got[0, 1] == pytest.approx([math.log(0.25), math.log(0.75)], abs=1e-15)
    assert got[1, 0] == pytest.approx([math.log(0.5)] * 2, abs=1e-15)


def test_kl_rows_of_hand_examples() -> None:
    # row 0: p = (1/2, 1/2), q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3); row 1 identical: 0
    ref = np.array([[0.0, 0.0], [2.0, 1.0]])
    other = np.array([[math.log(3.0), 0.0], [7.0, 6.0]])  # a shift of every logit changes nothing
    got = kl_rows(ref, other)
    assert got.shape == (2,)
    assert got[0] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    assert got[1] == pytest.approx(0.0, abs=1e-15)


def test_kl_is_reference_first_and_not_symmetric() -> None:
    # KL(q || p) for the same pair: 3/4 ln(3/2) + 1/4 ln(1/2)
    back = kl_rows(np.array([math.log(3.0), 0.0]), np.array([0.0, 0.0]))
    assert back == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel=1e-12)
    assert back != pytest.approx(0.5 * math.log(4 / 3), rel=1e-3)


def test_kl_rows_per_position_of_a_batch_and_huge_logits() -> None:
    ref = np.zeros((2, 3, 4))
    other = np.zeros((2, 3, 4))
    other[1, 2] = [1000.0, 0.0, 0.0, 0.0]  # q puts all mass on token 0: KL = sum 1/4 ln(1/4 / q_i)
    got = kl_rows(ref, other)
    assert got.shape == (2, 3) and np.isfinite(got).all()
    assert got[0] == pytest.approx([0.0] * 3, abs=1e-15)
    want = 0.25 * (math.log(0.25) - 0.0) + 3 * 0.25 * (math.log(0.25) + 1000.0)  # log q = (0, -1000, -1000, -1000)
    assert got[1, 2] == pytest.approx(want, rel=1e-9)


def test_token_logprobs_picks_each_rows_target_by_hand() -> None:
    # rows p = (1/4, 3/4) and (1/2, 1/2); exp(1000) overflows float64: only the max-shift keeps it finite
    logits = np.array([[0.0, math.log(3.0)], [1000.0, 1000.0]], dtype=np.float32)
    before = logits.copy()
    got = token_logprobs(logits, [1, 0])
    assert got.dtype == np.float64 and got.shape == (2,)
    assert got == pytest.approx([math.log(0.75), math.log(0.5)], abs=1e-7)  # ln 3 rounded to fp32: measured 5.0e-9
    assert (logits == before).all()  # worked on a copy
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32) * 4
    t = np.array([0, 6, 3, 3, 1])
    assert (token_logprobs(x, t) == log_softmax(x)[np.arange(5), t]).all()  # the same operations, bit for bit
    assert token_logprobs(np.zeros((0, 3)), []).shape == (0,)

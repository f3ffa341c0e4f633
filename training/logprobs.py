"""Log-probabilities and KL divergence of logits, in float64 numpy: the one copy every comparison
(parity, evaluation, ONNX export checks) uses. A leaf module: numpy only."""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the last axis, computed in float64 (max-shifted: exact for large logits)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_rows(ref_logits: np.ndarray, other_logits: np.ndarray) -> np.ndarray:
    """KL(p_ref || p_other) per row (every axis but the last), in nats."""
    lp, lq = log_softmax(ref_logits), log_softmax(other_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)

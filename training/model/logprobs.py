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


def token_logprobs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(targets[i]) under row i of (N, V) logits: `log_softmax(logits)[i, targets[i]]`, computed by the
    same float64 operations (so bit for bit equal) but in one float64 copy worked in place, which is ~10x
    less CPU for a large vocabulary (evaluation scores every token of every window through it)."""
    x = np.array(logits, dtype=np.float64)  # always a copy: the caller's logits stay as they are
    m = x.max(axis=-1, keepdims=True)
    picked = x[np.arange(x.shape[0]), np.asarray(targets, dtype=np.int64)] - m[:, 0]
    np.subtract(x, m, out=x)
    np.exp(x, out=x)
    return picked - np.log(x.sum(axis=-1))

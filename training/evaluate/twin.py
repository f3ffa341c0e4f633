"""The random-initialized twin: the same config with fresh weights from a fixed seed, scored on the
same tokens. A random-init model sits near ln(vocab) nats per token; the twin gate passes when the
trained model is at least `margin` nats/token below it (the reference run had 0.93 against 12.60)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from training.evaluate.providers import EvalError
from training.model.decoder import ModelConfig, Transformer
from training.runfiles.gate_results import GateResult

TWIN_SEED = 0  # the random-init twin is always built from this seed unless asked otherwise
TWIN_MARGIN = 1.0  # nats/token the trained model must beat its twin by
GATE_BATCH = 8  # windows per forward in the twin gate

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)


def make_twin(cfg: ModelConfig, seed: int = TWIN_SEED, device: torch.device | str = "cpu") -> Transformer:
    """The same architecture, freshly initialized from a fixed seed (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin = Transformer(cfg)
    return twin.to(device).eval()


def _as_batches(token_windows: torch.Tensor | np.ndarray | Iterable, batch_size: int) -> list[Batch]:
    """(inputs, targets) batches from a 2-D tensor/array of windows, 1-D windows, or (x, y) pairs."""
    if isinstance(token_windows, np.ndarray):  # int64 first: token shards are uint16, which few torch ops support
        token_windows = torch.from_numpy(token_windows.astype(np.int64))
    if isinstance(token_windows, torch.Tensor):
        if token_windows.dim() != 2:
            raise EvalError(f"token windows must be 2-D (N, T), got shape {tuple(token_windows.shape)}")
        token_windows = list(token_windows)
    batches: list[Batch] = []
    pending: list[torch.Tensor] = []

    def flush() -> None:
        if pending:
            w = torch.stack(pending).long()
            batches.append((w[:, :-1], w[:, 1:]))
            pending.clear()

    for item in token_windows:
        if isinstance(item, (tuple, list)) and len(item) == 2 and all(torch.is_tensor(t) for t in item):
            x, y = (t.long() for t in item)  # WindowLoader.next_batch() output
            batches.append((x[None], y[None]) if x.dim() == 1 else (x, y))
            continue
        w = torch.as_tensor(np.asarray(item, dtype=np.int64))
        if w.dim() != 1 or w.numel() < 2:
            raise EvalError("each token window must be a 1-D sequence of at least 2 ids")
        if pending and (len(pending) >= batch_size or pending[0].numel() != w.numel()):
            flush()
        pending.append(w)
    flush()
    if not batches:
        raise EvalError("no token windows to score")
    return batches


@torch.no_grad()
def window_nll(model: Transformer, batches: Sequence[Batch]) -> tuple[float, int]:
    """(summed NLL in nats, token count) of targets given inputs, in fp32."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for x, y in batches:
            logits = model(x.to(device))
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1),
                                           reduction="sum"))
            count += y.numel()
    finally:
        model.train(was_training)
    return total, count


@dataclass(frozen=True)
class TwinNLL:
    model: float  # mean NLL per token, nats
    twin: float
    tokens: int
    seed: int


def nll_twin(model: Transformer, cfg: ModelConfig | None, token_windows, *, seed: int = TWIN_SEED,
             batch_size: int = GATE_BATCH) -> TwinNLL:
    """Mean NLL per token of `model` and of its random-init twin (same config, fixed seed) on the same windows.

    token_windows: a 2-D tensor/array (N, T) of token windows, an iterable of 1-D windows, or an iterable
    of (inputs, targets) batches as `training.data.loaders.WindowLoader.next_batch` returns them.
    """
    cfg = cfg or model.cfg
    batches = _as_batches(token_windows, batch_size)
    m_sum, n = window_nll(model, batches)
    twin = make_twin(cfg, seed, next(model.parameters()).device)
    t_sum, _ = window_nll(twin, batches)
    return TwinNLL(m_sum / n, t_sum / n, n, seed)


def twin_result(model_nll: float, twin_nll: float, tokens: int, *, margin: float = TWIN_MARGIN,
                seed: int = TWIN_SEED, what: str = "held-out") -> GateResult:
    """Gate "twin" from the two mean NLLs (nats/token) over the same `tokens`."""
    gap = twin_nll - model_nll
    passed = math.isfinite(gap) and gap >= margin
    return GateResult(
        name="twin", passed=passed, value=round(model_nll, 4),
        threshold=f"<= twin - {margin:g} nat/token",
        detail=(f"{what} NLL {model_nll:.3f} vs random-init twin {twin_nll:.3f} (seed {seed}) over {tokens} tokens: "
                f"gap {gap:.3f} nat/token" + ("" if passed else f" < margin {margin:g}: the model has not learned")))


def twin_gate(model: Transformer, cfg: ModelConfig | None, token_windows, *, margin: float = TWIN_MARGIN,
              seed: int = TWIN_SEED, batch_size: int = GATE_BATCH) -> GateResult:
    """Gate "twin": held-out NLL must be at least `margin` nats/token below the random-init twin's."""
    r = nll_twin(model, cfg, token_windows, seed=seed, batch_size=batch_size)
    return twin_result(r.model, r.twin, r.tokens, margin=margin, seed=seed)

"""The ONNX export's own checks: ONNX Runtime against PyTorch at shapes unlike the traced ones
(never both models in memory at once), and KL(fp32 || quantized) on a probe text."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from export.onnx.onnx_graph import Decoder, example_inputs
from export.onnx.onnx_weights import OnnxExportError, Weights
from serving.backends.onnxrt_backend import input_names, output_names
from training.model.decoder import ModelConfig, Transformer
from training.model.logprobs import kl_rows

CHECK_SHAPES = ((2, 4, 0), (2, 1, 3))  # (batch, sequence, past) of the export's own check: unlike the traced
EXPORT_TOLERANCE = 1e-3  # fp32 ONNX vs PyTorch max |logit diff| that fails the export's own check


@contextmanager
def _session(path: Path) -> Iterator:
    import onnxruntime as ort

    so = ort.SessionOptions()
    # A check, not a server: keep ONNX Runtime to one copy of the weights. Prepacking makes a second,
    # packed copy of every MatMul weight; constant folding materializes the tied head's transpose.
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_cpu_mem_arena = False
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    try:
        yield sess
    finally:
        del sess


def _torch_model(weights_file: Path, cfg: ModelConfig) -> Transformer:
    """The fp32 model with the checkpoint's tensors as its parameters (read one at a time and
    assigned, not copied: one copy of the weights in memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    w = Weights(weights_file)
    model.load_state_dict({k: w.tensor(k) for k in w.names()}, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise OnnxExportError(f"{weights_file}: checkpoint lacks {missing[0]}")
    return model.eval()


def check_against_torch(path: Path, weights_file: Path, cfg: ModelConfig,
                        probe: np.ndarray | None = None) -> tuple[dict, np.ndarray | None]:
    """ONNX Runtime first (outputs kept, session freed), then PyTorch: never both models at once.
    Returns the report and, when `probe` (1, T) ids are given, ONNX Runtime's logits for them (the
    reference the quantized variants are measured against: one fp32 session serves both)."""
    n = cfg.n_layers
    cases = [example_inputs(cfg, b, s, p, seed=1) for b, s, p in CHECK_SHAPES]
    with _session(path) as sess:
        got = [sess.run(output_names(n), {k: a.numpy() for k, a in zip(input_names(n), args, strict=True)})
               for args in cases]
        ref_logits = None if probe is None else _probe_logits(sess, probe, cfg)
    del sess  # the `with` name outlives the block: without this the session (its weights) stays alive
    model = _torch_model(weights_file, cfg)
    worst = 0.0
    with torch.no_grad():
        for args, outs in zip(cases, got, strict=True):
            ref = Decoder(model)(*args)
            worst = max(worst, *(float(np.abs(o - r.numpy()).max()) for o, r in zip(outs, ref, strict=True)))
    del model
    if not worst <= EXPORT_TOLERANCE:
        raise OnnxExportError(f"{path.name}: ONNX Runtime disagrees with PyTorch (max |diff| {worst:.3g} > "
                              f"{EXPORT_TOLERANCE}); the export is wrong")
    return {"max_abs_diff_vs_torch": worst}, ref_logits


def _probe_logits(sess, ids: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """(T, V) logits of one (1, T) row from an empty cache."""
    t = ids.shape[1]
    feed = {"input_ids": ids, "attention_mask": np.ones((1, t), np.int64),
            "position_ids": np.arange(t, dtype=np.int64)[None]}
    empty = np.zeros((1, cfg.n_kv_heads, 0, cfg.head_dim), np.float32)
    feed.update({n: empty for n in input_names(cfg.n_layers)[3:]})
    return sess.run(["logits"], feed)[0][0]


def probe_logits(path: Path, ids: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    with _session(path) as sess:
        return _probe_logits(sess, ids, cfg)


def kl_report(ref: np.ndarray, q: np.ndarray) -> dict:
    """Mean/max KL(fp32 || quantized) over positions, top-1 agreement, max |logit diff|."""
    kl = kl_rows(ref, q)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float((ref.argmax(-1) == q.argmax(-1)).mean()),
            "max_abs_diff": float(np.abs(ref - q).max()), "finite": bool(np.isfinite(q).all())}

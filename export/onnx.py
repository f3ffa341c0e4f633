"""Export a checkpoint to ONNX: one decoder with a KV cache, plus int8 and int4 variants.

    out_dir/model.onnx        fp32 (weights as external data `model.onnx.data` only past protobuf's 2 GB)
    out_dir/model-int8.onnx   onnxruntime dynamic quantization (MatMulInteger, per-channel int8 weights)
    out_dir/model-int4.onnx   onnxruntime MatMulNBits (4-bit blockwise weights, fp32 activations)
    out_dir/tokenizer.model   the checkpoint's SentencePiece model
    out_dir/onnx_config.json  model config, io names, cache shapes, tokenizer sha256, special ids, checks

Inputs and outputs are named as optimum names them (`serving.onnxrt.input_names/output_names`), with
dynamic batch, sequence and past length; the first pass takes empty past tensors (B, kv, 0, hd).

Exporter: torch.export + the ONNX translator (`dynamo=True`, torch's default). It handles the model as
written (SDPA with a boolean mask, rotate-half RoPE, GQA repeat_interleave, the tied head stored
once), takes `torch.export.Dim` dynamic shapes, and its graph agrees with PyTorch to ~1e-6; past
length 0 works because the graph is traced at a past length of 2+ and stays symbolic.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from serving.onnxrt import (
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    PADDING_SIDE,
    TOKENIZER_FILE,
    VARIANT_FILES,
    input_names,
    output_names,
)
from training.checkpoint import load_model
from training.logprobs import kl_rows
from training.model import Transformer
from training.tokenizer import Tokenizer

PROTOBUF_LIMIT = 2 * 1024**3  # a single .onnx file cannot hold more; beyond it weights go to .data
EXTERNAL_DATA_SUFFIX = ".data"
# Example shapes the graph is traced at. They only need to be distinct and >= 2 (torch.export
# specializes sizes 0 and 1); every one of them stays symbolic in the exported graph.
TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 3, 5, 7
EXPORT_TOLERANCE = 1e-3  # fp32 ONNX vs PyTorch max |logit diff| that fails the export's own check
INT4_BLOCK_SIZE = 32  # weights per 4-bit block, each with its own scale and zero point
INT4_SYMMETRIC = False
QUANTIZED_OPS = ("MatMul", "Gather")  # every weight matrix: projections, head, embedding
PROBE_TEXT = "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। চিরদিন তোমার আকাশ, তোমার বাতাস. The quick brown fox."


class OnnxExportError(ValueError):
    pass


class _Decoder(nn.Module):
    """Flat tensors in optimum's order -> (logits, present.0.key, present.0.value, ...)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        pkv = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, presents = self.model.forward_with_cache(input_ids, position_ids, pkv, attention_mask)
        return (logits, *[t for kv in presents for t in kv])


def _example_inputs(model: Transformer, batch: int, seq: int, past: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    kv = [torch.randn(batch, cfg.n_kv_heads, past, cfg.head_dim, generator=g) for _ in range(2 * cfg.n_layers)]
    return (ids, mask, pos, *kv)


def _dynamic_shapes(n_layers: int) -> tuple:
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("sequence_length")
    past = torch.export.Dim("past_sequence_length")
    total = torch.export.Dim("total_sequence_length")
    return ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
            tuple({0: batch, 2: past} for _ in range(2 * n_layers)))


def _param_bytes(model: Transformer) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


def _export_fp32(model: Transformer, path: Path, opset: int | None) -> bool:
    """torch.onnx.export (dynamo); returns whether the weights went to external data."""
    n = model.cfg.n_layers
    external = _param_bytes(model) >= PROTOBUF_LIMIT
    with warnings.catch_warnings(), torch.no_grad():
        # the exporter warns that each shared Dim name is used once; that is what we ask for
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.onnx.export(_Decoder(model).eval(), _example_inputs(model, TRACE_BATCH, TRACE_SEQ, TRACE_PAST), str(path),
                          input_names=input_names(n), output_names=output_names(n), opset_version=opset,
                          dynamo=True, dynamic_shapes=_dynamic_shapes(n), external_data=external, verbose=False)
    return external


def _session(path: Path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _ort_logits(sess, ids: np.ndarray, cfg) -> np.ndarray:
    """Full-sequence pass of one (1, T) row from an empty cache."""
    t = ids.shape[1]
    feed = {"input_ids": ids, "attention_mask": np.ones((1, t), np.int64),
            "position_ids": np.arange(t, dtype=np.int64)[None]}
    empty = np.zeros((1, cfg.n_kv_heads, 0, cfg.head_dim), np.float32)
    feed.update({n: empty for n in input_names(cfg.n_layers)[3:]})
    return sess.run(["logits"], feed)[0][0]


def _check_fp32(model: Transformer, path: Path) -> dict:
    """The export's own check: ONNX Runtime vs PyTorch at a traced-unlike shape (B=2, past 0 and past 3)."""
    sess = _session(path)
    names = input_names(model.cfg.n_layers)
    worst = 0.0
    for batch, seq, past in ((2, 4, 0), (2, 1, 3)):
        args = _example_inputs(model, batch, seq, past, seed=1)
        with torch.no_grad():
            ref = _Decoder(model)(*args)
        got = sess.run(output_names(model.cfg.n_layers), {n: a.numpy() for n, a in zip(names, args, strict=True)})
        worst = max(worst, *(float(np.abs(g - r.numpy()).max()) for g, r in zip(got, ref, strict=True)))
    if not worst <= EXPORT_TOLERANCE:
        raise OnnxExportError(f"{path}: ONNX Runtime disagrees with PyTorch (max |diff| {worst:.3g} > "
                              f"{EXPORT_TOLERANCE}); the export is wrong")
    return {"max_abs_diff_vs_torch": worst}


def _kl_report(ref: np.ndarray, q: np.ndarray) -> dict:
    """Mean/max KL(fp32 || quantized) over positions, top-1 agreement, max |logit diff|."""
    kl = kl_rows(ref, q)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float((ref.argmax(-1) == q.argmax(-1)).mean()),
            "max_abs_diff": float(np.abs(ref - q).max()), "finite": bool(np.isfinite(q).all())}


def fold_weight_transposes(model):
    """Replace each Transpose of an initializer by a transposed initializer (in place; returns `model`).

    The exporter feeds the tied output head as Transpose(tok_embeddings) -> MatMul; onnxruntime's
    quantizers only quantize a MatMul whose weight is an initializer, so without this the largest
    matrix of a small model (vocab x d_model) would stay fp32 in the int8/int4 files."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    kept = []
    for node in model.graph.node:
        if node.op_type == "Transpose" and node.input[0] in inits:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            w = numpy_helper.to_array(inits[node.input[0]])
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.transpose(perm)), node.output[0]))
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model


class _quiet:
    """onnxruntime's quantizers log every node at INFO (and set up root logging on import): silence them."""

    def __enter__(self):
        logging.disable(logging.WARNING)

    def __exit__(self, *exc):
        logging.disable(logging.NOTSET)


def quantize_int8(model, dst: Path, external: bool) -> None:
    """Dynamic quantization: int8 per-channel weights for every MatMul with a constant weight (the
    head included) and the embedding Gather; activations are quantized per tensor at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet():
        quantize_dynamic(model, dst, op_types_to_quantize=list(QUANTIZED_OPS), per_channel=True,
                         weight_type=QuantType.QInt8, use_external_data_format=external)


def quantize_int4(model, dst: Path, external: bool) -> None:
    """MatMulNBits (and GatherBlockQuantized for the embedding): asymmetric 4-bit blocks of
    INT4_BLOCK_SIZE weights (a scale and a zero point each, as llama.cpp's Q4_1), round-to-nearest;
    activations stay fp32. Asymmetric: measured on the quickstart model, symmetric blocks left
    top-1 agreement at the 90% threshold."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    cfg = DefaultWeightOnlyQuantConfig(block_size=INT4_BLOCK_SIZE, is_symmetric=INT4_SYMMETRIC,
                                       op_types_to_quantize=QUANTIZED_OPS)
    with _quiet():
        q = MatMulNBitsQuantizer(model, block_size=INT4_BLOCK_SIZE, is_symmetric=INT4_SYMMETRIC,
                                 op_types_to_quantize=QUANTIZED_OPS,
                                 algo_config=cfg)
        q.process()
        q.model.save_model_to_file(str(dst), use_external_data_format=external)


def planned_outputs(out_dir: Path, int8: bool, int4: bool) -> list[Path]:
    """The files an export with these variants writes (python -m export checks them all before writing)."""
    names = [VARIANT_FILES["fp32"]] + ([VARIANT_FILES["int8"]] if int8 else []) + (
        [VARIANT_FILES["int4"]] if int4 else []) + [TOKENIZER_FILE, CONFIG_FILE]
    return [out_dir / n for n in names]


def export_model(model: Transformer, tokenizer: Tokenizer, out_dir: Path, *, int8: bool = False, int4: bool = False,
                 force: bool = False, opset: int | None = None, source: dict | None = None) -> list[Path]:
    """Export an in-memory model (eval mode, fp32, CPU) with its tokenizer; returns the files written.
    One function on purpose (long): it is the sequence that makes an export complete — old files out,
    fp32 written and checked, each quantized variant checked against it, config.json last (its
    presence marks a complete export, so it must come after every check)."""
    import onnx

    out_dir = Path(out_dir)
    targets = planned_outputs(out_dir, int8, int4)
    if any(p.exists() for p in targets) and not force:
        raise OnnxExportError(f"{next(p for p in targets if p.exists())} already exists; pass --force to overwrite")
    # with force, every file of an earlier export goes (config first: it marks a complete export, and
    # a stale int8 file must not be served beside a new fp32 one)
    existing = [p for p in [out_dir / CONFIG_FILE, *planned_outputs(out_dir, True, True)] if p.exists()] + sorted(
        p for name in VARIANT_FILES.values() for p in out_dir.glob(name + "*" + EXTERNAL_DATA_SUFFIX))
    cfg = model.cfg
    if tokenizer.vocab_size != cfg.vocab_size:
        raise OnnxExportError(f"tokenizer has {tokenizer.vocab_size} tokens, the model {cfg.vocab_size}")
    model = model.float().cpu().eval()  # in place: export_onnx owns its model
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in dict.fromkeys(existing):
        p.unlink()

    fp32 = out_dir / VARIANT_FILES["fp32"]
    t0 = time.perf_counter()
    external = _export_fp32(model, fp32, opset)
    timings = {"fp32_export_s": time.perf_counter() - t0}
    onnx.checker.check_model(str(fp32), full_check=True)  # by path: works past 2 GB too
    check = _check_fp32(model, fp32)
    written = [fp32] + ([fp32.with_name(fp32.name + EXTERNAL_DATA_SUFFIX)] if external else [])

    probe = np.asarray([tokenizer.encode(PROBE_TEXT, bos=True)[:cfg.max_seq_len]], dtype=np.int64)
    ref = _ort_logits(_session(fp32), probe, cfg)
    quality = {}
    for variant, wanted, fn in (("int8", int8, quantize_int8), ("int4", int4, quantize_int4)):
        if not wanted:
            continue
        dst = out_dir / VARIANT_FILES[variant]
        before = set(out_dir.iterdir())
        t0 = time.perf_counter()
        fn(fold_weight_transposes(onnx.load(str(fp32))), dst, external)  # a fresh copy: quantizers edit in place
        timings[f"{variant}_quantize_s"] = time.perf_counter() - t0
        onnx.checker.check_model(str(dst))
        quality[variant] = _kl_report(ref, _ort_logits(_session(dst), probe, cfg))
        if not quality[variant]["finite"]:
            raise OnnxExportError(f"{dst}: quantized model produces non-finite logits")
        written += [dst] + sorted(set(out_dir.iterdir()) - before - {dst})  # its external data, if any

    tokenizer.save(out_dir / TOKENIZER_FILE)
    opset_used = next(o.version for o in onnx.load(str(fp32), load_external_data=False).opset_import
                      if o.domain in ("", "ai.onnx"))
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
        "inputs": input_names(cfg.n_layers), "outputs": output_names(cfg.n_layers),
        "dynamic_axes": {"batch": "all inputs/outputs dim 0", "sequence_length": "input_ids/position_ids/logits dim 1",
                         "past_sequence_length": "past_key_values.* dim 2 (0 on the first pass)",
                         "total_sequence_length": "attention_mask dim 1 = past + sequence"},
        "padding_side": PADDING_SIDE,
        "files": {v: VARIANT_FILES[v] for v in ("fp32", "int8", "int4") if v == "fp32" or {"int8": int8, "int4": int4}[v]},
        "external_data": external, "opset": opset_used,
        "tokenizer_file": TOKENIZER_FILE, "tokenizer_sha256": tokenizer.sha256,
        "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id,
        "im_start_id": tokenizer.im_start_id, "im_end_id": tokenizer.im_end_id,
        "eos_ids": [tokenizer.eos_id, tokenizer.im_end_id],
        "quantization": {"int8": "onnxruntime quantize_dynamic: MatMul (QInt8 per channel) + Gather",
                         "int4": f"onnxruntime MatMulNBits + GatherBlockQuantized: 4 bits asymmetric, block {INT4_BLOCK_SIZE}, "
                                 "round-to-nearest"},
        "checks": {"fp32": check, **quality, "probe_tokens": int(probe.shape[1])},
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": _ort_version()},
        "source": source or {},
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return written + [out_dir / TOKENIZER_FILE, out_dir / CONFIG_FILE]


def _ort_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def export_onnx(source, out_dir: Path, *, int8: bool = False, int4: bool = False, force: bool = False,
                opset: int | None = None) -> list[Path]:
    """Export the checkpoint at `source` (a RUN_DIR or checkpoint folder) into `out_dir`."""
    existing = [p for p in planned_outputs(Path(out_dir), int8, int4) if p.exists()]
    if existing and not force:  # before loading anything: refusing should be instant
        raise OnnxExportError(f"{existing[0]} already exists; pass --force to overwrite")
    model, ck = load_model(source)
    return export_model(model, ck.tokenizer, Path(out_dir), int8=int8, int4=int4, force=force, opset=opset,
                        source={"checkpoint": str(ck.path), "step": ck.state.get("step")})


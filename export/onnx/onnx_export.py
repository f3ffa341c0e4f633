"""Export a checkpoint to ONNX: one decoder with a KV cache (fp32), plus int8 and int4 variants,
streamed: no step ever holds the whole model twice.

    out_dir/model.onnx        fp32 graph; its weights in model.onnx_data (external data, named as optimum
                              and transformers.js name it; exports before were model.onnx.data)
    out_dir/model-int8.onnx   int8 per-channel weights, DynamicQuantizeMatMul (activations quantized at
                              run time) and an 8-bit GatherBlockQuantized embedding (+ model-int8.onnx_data)
    out_dir/model-int4.onnx   MatMulNBits + GatherBlockQuantized, 4-bit asymmetric blocks of 32 (+ its _data)
    out_dir/tokenizer.model   the checkpoint's SentencePiece model
    out_dir/onnx_config.json  model config, io names, tokenizer sha256, special ids, checks, timings
    out_dir/config.json, generation_config.json, tokenizer.json, tokenizer_config.json
                              the HF files transformers.js reads beside the model (export.onnx.onnx_hub)

Inputs and outputs are named as optimum names them (`serving.backends.onnxrt_backend.input_names/output_names`), with
dynamic batch, sequence and past length; the first pass takes empty past tensors (B, kv, 0, hd).

How (torch.onnx over the real model held the weights several times over: 384 s and 5.4x the fp32
size in RSS for `400m`):
1. the model is built on the meta device and every parameter replaced by a zero-stride view of one
   scalar: real shapes, 4 bytes of storage; the tied head stays one parameter;
2. torch.onnx's TorchScript exporter traces it with `export_params=False` (weights become graph
   inputs, never serialized) and no constant folding: seconds for 32 layers;
3. each weight input becomes an initializer whose bytes are streamed from `model.safetensors`
   (memory-mapped), one tensor at a time, into the variant's external data file; a weight consumed
   only through Transpose(perm=1,0) is written transposed and the Transpose dropped, so every
   projection is `MatMul(x, W^T)` with an initializer weight. The int8/int4 files are built the
   same way, each tensor quantized as it is read (int4 by onnxruntime's own MatMulNBits quantizer);
4. checks: ONNX Runtime vs PyTorch at shapes unlike the traced ones (session freed before the
   PyTorch model is loaded: never both at once), then KL(fp32 || variant) on a Bangla probe.

Everything is written into a temporary folder beside `out_dir` and moved into place at the end:
a failure leaves nothing half-written, and nothing existing is replaced without `force`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from export.onnx.genai import GENAI_DIR, write_genai_files
from export.onnx.onnx_check import check_against_torch, kl_report, probe_logits
from export.onnx.onnx_graph import (
    TIED_HEAD,
    TIED_SOURCE,
    Initializer,
    export_graph,
    placeholder_model,
    plan_initializers,
    set_nodes,
    transpose_perm,
)
from export.onnx.onnx_hub import HUB_FILES, write_hub_files
from export.onnx.onnx_weights import LEGACY_DATA_SUFFIX, DataFile, OnnxExportError, Weights, data_file
from serving.backends.onnxrt_backend import (
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    PADDING_SIDE,
    TOKENIZER_FILE,
    VARIANT_FILES,
    input_names,
    output_names,
)
from training.runfiles import layout

# The exporter's parts (#26 split): onnx_graph (trace, plan of initializers), onnx_weights (streamed
# bytes), onnx_check (its own checks); the names callers take from here stay importable from here.
__all__ = ["OnnxExportError", "build_export", "data_file", "export_onnx", "install", "onnx_config",
           "placeholder_model", "planned_outputs", "write_variant"]

MS_DOMAIN = "com.microsoft"  # MatMulNBits, GatherBlockQuantized, DynamicQuantizeMatMul
INT4_BLOCK_SIZE = 32  # weights per 4-bit block, each with its own scale and zero point
INT4_SYMMETRIC = False  # asymmetric: symmetric blocks left top-1 at the 90% threshold (quickstart model)
# The output head (tied or not) stays 8-bit in the int4 file, as llama.cpp's Q4_K_M keeps output.weight
# at Q6_K: every logit goes through it, and at 4 bits it alone cost top-1 agreement (see docs/onnx.md).
INT4_HEAD = "int8"
HEAD_WEIGHTS = (TIED_HEAD, TIED_SOURCE)  # a MatMul over either is the head (the embedding is a Gather)
INT8_GATHER_BLOCK = 32  # the int8 embedding: 8-bit blocks (GatherBlockQuantized), as int4's
INT8_MAX = 127  # symmetric per-channel int8 weights in [-127, 127]
PROBE_TEXT = "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। চিরদিন তোমার আকাশ, তোমার বাতাস. The quick brown fox."
QUANTIZED = ("int8", "int4")


def planned_outputs(out_dir: Path, int8: bool, int4: bool) -> list[Path]:
    """The files an export with these variants writes (python -m export checks them all before writing)."""
    variants = ["fp32"] + [v for v, on in (("int8", int8), ("int4", int4)) if on]
    names = [n for v in variants for n in (VARIANT_FILES[v], data_file(VARIANT_FILES[v]))]
    return [Path(out_dir) / n for n in [*names, TOKENIZER_FILE, *HUB_FILES, CONFIG_FILE]]


def _quantize_int8_matmul(node, w: np.ndarray, data: DataFile) -> list:
    """MatMul(x, W) -> DynamicQuantizeMatMul: W symmetric int8 per output column (what onnxruntime's
    quantize_dynamic(per_channel=True) writes once its optimizer fuses MatMulInteger)."""
    from onnx import TensorProto, helper

    scale = np.abs(w).max(axis=0) / INT8_MAX
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    b = node.input[1]
    inits = [data.add_array(b + "_int8", q), data.add_array(b + "_scale", scale),
             data.add_bytes(b + "_zero_point", TensorProto.INT8, scale.shape, np.zeros(scale.shape, np.int8))]
    return inits, [helper.make_node("DynamicQuantizeMatMul", [node.input[0], *(t.name for t in inits)],
                                    list(node.output), name=node.name + "_int8", domain=MS_DOMAIN)]


def _quantize_int8_gather(node, w: np.ndarray, data: DataFile) -> list:
    """Gather(E, ids) -> GatherBlockQuantized(bits=8): asymmetric uint8 blocks along each row."""
    from onnx import helper

    v, d = w.shape
    if d % INT8_GATHER_BLOCK:  # no whole blocks: the embedding stays fp32
        return [], [node]
    blocks = w.reshape(v, d // INT8_GATHER_BLOCK, INT8_GATHER_BLOCK)
    lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
    scale = ((hi - lo) / 255).astype(np.float32)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    zp = np.clip(np.rint(-lo / scale), 0, 255).astype(np.uint8)
    q = np.clip(np.rint(blocks / scale[..., None]) + zp[..., None], 0, 255).astype(np.uint8).reshape(v, d)
    e = node.input[0]
    inits = [data.add_array(e + "_uint8", q), data.add_array(e + "_scales", scale), data.add_array(e + "_zero_points", zp)]
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return inits, [helper.make_node("GatherBlockQuantized", [inits[0].name, node.input[1], inits[1].name, inits[2].name],
                                    list(node.output), name=node.name + "_int8", domain=MS_DOMAIN, gather_axis=axis,
                                    quantize_axis=1, block_size=INT8_GATHER_BLOCK, bits=8)]


def _quantize_int4(node, w: np.ndarray, data: DataFile) -> list:
    """onnxruntime's own MatMulNBits / GatherBlockQuantized quantizer, run on a graph of one tensor."""
    from onnx import GraphProto, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    name = node.input[1] if node.op_type == "MatMul" else node.input[0]
    one = GraphProto(initializer=[numpy_helper.from_array(w, name)])
    cfg = DefaultWeightOnlyQuantConfig(block_size=INT4_BLOCK_SIZE, is_symmetric=INT4_SYMMETRIC,
                                       op_types_to_quantize=("MatMul", "Gather"))
    with _quiet():
        nodes = DefaultWeightOnlyQuantizer(cfg).quantize(node, [one])
    return [data.add_proto(t) for t in one.initializer if t.name != name], nodes


class _quiet:
    """onnxruntime's quantizers log every node at INFO: silence them."""

    def __enter__(self):
        logging.disable(logging.WARNING)

    def __exit__(self, *exc):
        logging.disable(logging.NOTSET)


def write_variant(graph_proto, plan: list[Initializer], weights: Weights, model_path: Path, variant: str) -> int:
    """Write `model_path` and its data file: `graph_proto` (the planned graph, no initializers) with
    every weight streamed from the checkpoint, quantized per `variant` ("fp32", "int8", "int4") as it
    is read. Returns the data file's size."""
    import onnx
    from onnx import helper

    proto = onnx.ModelProto()
    proto.CopyFrom(graph_proto)
    g = proto.graph
    items = {i.onnx_name: i for i in plan}
    data = DataFile(model_path.with_name(data_file(model_path.name)))
    try:
        if variant == "fp32":
            g.initializer.extend(data.add_array(i.onnx_name, weights.get(i)) for i in plan)
        else:
            nodes = []
            for node in g.node:  # the tied head: Transpose(E) -> MatMul becomes a MatMul over its own E^T
                src = items.get(node.input[0]) if node.input else None
                if src is not None and transpose_perm(node) == [1, 0]:
                    items[node.output[0]] = replace(src, onnx_name=node.output[0], transpose=not src.transpose,
                                                    shape=src.shape[::-1])
                else:
                    nodes.append(node)
            used: set[str] = set()
            out_nodes = []
            quantize = {"int8": {"MatMul": _quantize_int8_matmul, "Gather": _quantize_int8_gather},
                        "int4": {"MatMul": _quantize_int4, "Gather": _quantize_int4}}[variant]
            for node in nodes:
                w_in = 1 if node.op_type == "MatMul" else 0
                item = items.get(node.input[w_in]) if node.op_type in quantize and len(node.input) > w_in else None
                if item is None or len(item.shape) != 2:
                    out_nodes.append(node)
                    used.update(node.input)
                    continue
                how = quantize[node.op_type]
                if variant == "int4" and node.op_type == "MatMul" and item.checkpoint_name in HEAD_WEIGHTS:
                    how = {"int8": _quantize_int8_matmul, "int4": _quantize_int4}[INT4_HEAD]
                inits, new = how(node, weights.get(item), data)
                g.initializer.extend(inits)
                out_nodes += new
                used.update(x for n in new for x in n.input)
            set_nodes(g, out_nodes)
            g.initializer.extend(data.add_array(i.onnx_name, weights.get(i)) for i in plan if i.onnx_name in used)
            if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
                proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    finally:
        data.close()
    model_path.write_bytes(proto.SerializeToString())
    return data.offset


# ------------------------------------------------------------------------------------ the export
def build_export(src, folder: Path, *, int8: bool = False, int4: bool = False, opset: int | None = None,
                 check: bool = True) -> list[Path]:
    """Write every file of the export into `folder` (empty); returns them, onnx_config.json last.
    `src` is an export.manifest.Source."""
    import onnx

    cfg, tok = src.config, src.tokenizer
    weights_file = src.path / layout.MODEL_WEIGHTS
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    proto, weight_names = export_graph(cfg, opset)
    plan = plan_initializers(proto, weight_names, cfg)
    timings["graph_export_s"] = time.perf_counter() - t0
    weights = Weights(weights_file)
    variants = ["fp32"] + [v for v, on in (("int8", int8), ("int4", int4)) if on]
    written, sizes, checks = [], {}, {}
    ref = None
    probe = np.asarray([tok.encode(PROBE_TEXT, bos=True)[:cfg.max_seq_len]], dtype=np.int64)
    for v in variants:
        path = folder / VARIANT_FILES[v]
        t0 = time.perf_counter()
        sizes[v] = write_variant(proto, plan, weights, path, v)
        onnx.checker.check_model(str(path), full_check=v == "fp32")  # by path: reads no weights
        timings[f"{v}_write_s"] = time.perf_counter() - t0
        written += [path, path.with_name(data_file(path.name))]
        t0 = time.perf_counter()
        if v == "fp32":
            quantized = len(variants) > 1
            if check:
                checks["fp32"], ref = check_against_torch(path, weights_file, cfg, probe if quantized else None)
            elif quantized:
                ref = probe_logits(path, probe, cfg)
        else:
            checks[v] = kl_report(ref, probe_logits(path, probe, cfg))
            if not checks[v]["finite"]:
                raise OnnxExportError(f"{path.name}: quantized model produces non-finite logits")
        timings[f"{v}_check_s"] = time.perf_counter() - t0
    checks["probe_tokens"] = int(probe.shape[1])
    tok.save(folder / TOKENIZER_FILE)
    hub = write_hub_files(src, folder, variants)
    meta = onnx_config(src, variants, opset=next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
                       checks=checks, timings=timings, sizes=sizes)
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [*written, folder / TOKENIZER_FILE, *hub, folder / CONFIG_FILE]


def onnx_config(src, variants: list[str], *, opset: int, checks: dict, timings: dict, sizes: dict) -> dict:
    """onnx_config.json: what serving.backends.onnxrt_backend, export.onnx.genai and parity read."""
    import onnx
    import onnxruntime

    cfg, tok = src.config, src.tokenizer
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
        "inputs": input_names(cfg.n_layers), "outputs": output_names(cfg.n_layers),
        "dynamic_axes": {"batch": "all inputs/outputs dim 0", "sequence_length": "input_ids/position_ids/logits dim 1",
                         "past_sequence_length": "past_key_values.* dim 2 (0 on the first pass)",
                         "total_sequence_length": "attention_mask dim 1 = past + sequence"},
        "padding_side": PADDING_SIDE,
        "files": {v: VARIANT_FILES[v] for v in variants},
        "external_data": True, "external_data_bytes": sizes, "exporter": "streamed", "opset": opset,
        "tokenizer_file": TOKENIZER_FILE, "tokenizer_sha256": tok.sha256,
        "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id,
        "im_start_id": tok.im_start_id, "im_end_id": tok.im_end_id, "eos_ids": [tok.eos_id, tok.im_end_id],
        "quantization": {"int8": "DynamicQuantizeMatMul (int8 symmetric per output column) + GatherBlockQuantized "
                                 f"(8 bits asymmetric, block {INT8_GATHER_BLOCK})",
                         "int4": f"onnxruntime MatMulNBits + GatherBlockQuantized: 4 bits asymmetric, block "
                                 f"{INT4_BLOCK_SIZE}, round-to-nearest; the output head {INT4_HEAD} as in int8"},
        "checks": checks,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        "source": {"checkpoint": str(src.path), "step": src.step},
    }


def _old_export_files(out_dir: Path) -> list[Path]:
    """Every file of an earlier export in `out_dir`, its config first (it marks a complete export:
    a stale int8 file must never be served beside a new fp32 one), its GenAI folder last."""
    names = [CONFIG_FILE, TOKENIZER_FILE, *HUB_FILES] + [n for f in VARIANT_FILES.values()
                                                          for n in (f, data_file(f), f + LEGACY_DATA_SUFFIX)]
    return [out_dir / n for n in [*names, GENAI_DIR] if (out_dir / n).exists()]


def install(folder: Path, out_dir: Path, files: list[Path], force: bool) -> list[Path]:
    """Move the finished export from `folder` into `out_dir` (same file system: renames), config
    last, then the GenAI folder if one was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    old = _old_export_files(out_dir)
    if old and not force:  # checked again: another process may have written meanwhile
        raise OnnxExportError(f"{old[0]} already exists; pass --force to overwrite")
    for p in old:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    placed = []
    for f in [f for f in files if f.parent == folder]:
        os.replace(f, out_dir / f.name)
        placed.append(out_dir / f.name)
    if (folder / GENAI_DIR).is_dir():
        os.replace(folder / GENAI_DIR, out_dir / GENAI_DIR)
        placed += [out_dir / f.relative_to(folder) for f in files if f.parent != folder]
    return placed


def export_onnx(source, out_dir: Path, *, int8: bool = False, int4: bool = False, force: bool = False,
                opset: int | None = None, check: bool = True, genai: bool = False) -> list[Path]:
    """Export the checkpoint at `source` (a RUN_DIR or checkpoint folder, or an export.manifest.Source)
    into `out_dir`; returns the files written (onnx_config.json, then with `genai` the files of
    out_dir/genai/<variant>/ for ONNX Runtime GenAI, export.onnx.genai)."""
    from export.manifest import Source, load_source

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OnnxExportError(f"--out {out_dir}: exists and is not a folder")
    existing = [p for p in planned_outputs(out_dir, int8, int4) + [out_dir / GENAI_DIR] * genai if p.exists()]
    if existing and not force:  # before loading anything: refusing should be instant
        raise OnnxExportError(f"{existing[0]} already exists; pass --force to overwrite")
    src = source if isinstance(source, Source) else load_source(source)
    if src.tokenizer.vocab_size != src.config.vocab_size:
        raise OnnxExportError(f"tokenizer has {src.tokenizer.vocab_size} tokens, the model {src.config.vocab_size}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        files = build_export(src, folder, int8=int8, int4=int4, opset=opset, check=check)
        if genai:
            variants = ("fp32",) + ("int8",) * int8 + ("int4",) * int4
            files += write_genai_files(folder, src, variants=variants)
        return install(folder, out_dir, files, force)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

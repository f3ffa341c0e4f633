"""Export a checkpoint to ONNX: one decoder with a KV cache (fp32), plus int8 and int4 variants,
streamed: no step ever holds the whole model twice.

    out_dir/model.onnx        fp32 graph; its weights in model.onnx.data (external data)
    out_dir/model-int8.onnx   int8 per-channel weights, DynamicQuantizeMatMul (activations quantized at
                              run time) and an 8-bit GatherBlockQuantized embedding; weights in .data
    out_dir/model-int4.onnx   MatMulNBits + GatherBlockQuantized, 4-bit asymmetric blocks of 32; weights in .data
    out_dir/tokenizer.model   the checkpoint's SentencePiece model
    out_dir/onnx_config.json  model config, io names, tokenizer sha256, special ids, checks, timings

Inputs and outputs are named as optimum names them (`serving.onnxrt.input_names/output_names`), with
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
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from export import ExportError
from export.genai import GENAI_DIR, write_genai_files
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
from training import layout
from training.logprobs import kl_rows
from training.model import ModelConfig, Transformer

EXTERNAL_DATA_SUFFIX = ".data"
# Example shapes the graph is traced at: distinct and >= 2, so none is taken for a constant.
TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 3, 5, 7
CHECK_SHAPES = ((2, 4, 0), (2, 1, 3))  # (batch, sequence, past) of the export's own check: unlike the traced
EXPORT_TOLERANCE = 1e-3  # fp32 ONNX vs PyTorch max |logit diff| that fails the export's own check
GRAPH_OPSET = 18  # every op of the decoder exists there; ONNX Runtime and GenAI run it
MS_DOMAIN = "com.microsoft"  # MatMulNBits, GatherBlockQuantized, DynamicQuantizeMatMul
INT4_BLOCK_SIZE = 32  # weights per 4-bit block, each with its own scale and zero point
INT4_SYMMETRIC = False  # asymmetric: symmetric blocks left top-1 at the 90% threshold (quickstart model)
TIED_HEAD, TIED_SOURCE = "output.weight", "tok_embeddings.weight"  # the checkpoint stores a tied head once
# The output head (tied or not) stays 8-bit in the int4 file, as llama.cpp's Q4_K_M keeps output.weight
# at Q6_K: every logit goes through it, and at 4 bits it alone cost top-1 agreement (see docs/onnx.md).
INT4_HEAD = "int8"
HEAD_WEIGHTS = (TIED_HEAD, TIED_SOURCE)  # a MatMul over either is the head (the embedding is a Gather)
INT8_GATHER_BLOCK = 32  # the int8 embedding: 8-bit blocks (GatherBlockQuantized), as int4's
INT8_MAX = 127  # symmetric per-channel int8 weights in [-127, 127]
WRAPPER_PREFIX = "model."  # _Decoder holds the Transformer as `.model`: initializer names carry it
# Large tensors start at a page boundary of the data file so ONNX Runtime can memory-map them
# (onnx's own external-data writer uses the same rule).
ALIGN_THRESHOLD, PAGE, SMALL_ALIGN = 1 << 20, 4096, 64
PROBE_TEXT = "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। চিরদিন তোমার আকাশ, তোমার বাতাস. The quick brown fox."
QUANTIZED = ("int8", "int4")


class OnnxExportError(ExportError):
    pass


def data_file(model_file: str) -> str:
    return model_file + EXTERNAL_DATA_SUFFIX


def planned_outputs(out_dir: Path, int8: bool, int4: bool) -> list[Path]:
    """The files an export with these variants writes (python -m export checks them all before writing)."""
    variants = ["fp32"] + [v for v, on in (("int8", int8), ("int4", int4)) if on]
    names = [n for v in variants for n in (VARIANT_FILES[v], data_file(VARIANT_FILES[v]))]
    return [Path(out_dir) / n for n in [*names, TOKENIZER_FILE, CONFIG_FILE]]


# ------------------------------------------------------------------------------------ the graph
class _Decoder(nn.Module):
    """Flat tensors in optimum's order -> (logits, present.0.key, present.0.value, ...)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        pkv = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, presents = self.model.forward_with_cache(input_ids, position_ids, pkv, attention_mask)
        return (logits, *[t for kv in presents for t in kv])


def example_inputs(cfg: ModelConfig, batch: int, seq: int, past: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    kv = [torch.randn(batch, cfg.n_kv_heads, past, cfg.head_dim, generator=g) for _ in range(2 * cfg.n_layers)]
    return (ids, mask, pos, *kv)


def placeholder_model(cfg: ModelConfig) -> Transformer:
    """The model with real shapes and no weights: every parameter a zero-stride view of one scalar
    (4 bytes each; tied parameters stay tied). Each parameter gets its own value (1, 2, 3, ...):
    the exporter deduplicates initializers with equal contents, and real weights never are equal."""
    with torch.device("meta"):
        model = Transformer(cfg)
    swapped: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in swapped:
                value = torch.full((), float(len(swapped) + 1), dtype=torch.float32)
                swapped[id(p)] = nn.Parameter(value.expand(p.shape), requires_grad=False)
            module._parameters[name] = swapped[id(p)]
    return model.eval()


def _dynamic_axes(n_layers: int) -> dict[str, dict[int, str]]:
    ins, outs = input_names(n_layers), output_names(n_layers)
    axes = {ins[0]: {0: "batch", 1: "sequence_length"}, ins[1]: {0: "batch", 1: "total_sequence_length"},
            ins[2]: {0: "batch", 1: "sequence_length"}, outs[0]: {0: "batch", 1: "sequence_length"}}
    axes.update({n: {0: "batch", 2: "past_sequence_length"} for n in ins[3:]})
    axes.update({n: {0: "batch", 2: "total_sequence_length"} for n in outs[1:]})
    return axes


def export_graph(cfg: ModelConfig, opset: int | None = None):
    """The decoder graph as an onnx.ModelProto whose weights are graph inputs named by their
    parameter names; returns (proto, weight names). The TorchScript exporter with
    `export_params=False` and no constant folding (which would materialize transposed placeholders):
    a 32-layer graph in seconds, where the dynamo exporter spends minutes tracing."""
    import onnx

    n = cfg.n_layers
    with tempfile.TemporaryDirectory() as td, warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore")  # the TorchScript exporter's deprecation notice
        path = Path(td) / "graph.onnx"
        torch.onnx.export(_Decoder(placeholder_model(cfg)), example_inputs(cfg, TRACE_BATCH, TRACE_SEQ, TRACE_PAST),
                          str(path), input_names=input_names(n), output_names=output_names(n),
                          dynamic_axes=_dynamic_axes(n), opset_version=opset or GRAPH_OPSET, export_params=False,
                          do_constant_folding=False, dynamo=False)
        proto = onnx.load(str(path))
    fixed = set(input_names(n))
    return proto, [i.name for i in proto.graph.input if i.name not in fixed]


@dataclass(frozen=True)
class Initializer:
    onnx_name: str  # the name in the written graph
    checkpoint_name: str  # the tensor in model.safetensors
    transpose: bool  # written as W^T
    shape: tuple[int, ...]  # as written


def plan_initializers(proto, weight_names: list[str], cfg: ModelConfig) -> list[Initializer]:
    """Turn the weight inputs back into initializers (in place on `proto`). A weight whose only
    consumer is a Transpose(perm=[1,0]) is written transposed under the Transpose's output name and
    the node removed; others (the tied embedding: a Gather and the head's Transpose) stay."""
    g = proto.graph
    shapes = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in g.input}
    consumers: dict[str, list] = {}
    for node in g.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
    plan, drop = [], set()
    for name in weight_names:
        if name not in shapes:  # optimized away (unused)
            continue
        ck = name.removeprefix(WRAPPER_PREFIX)
        if cfg.tie_embeddings and ck == TIED_HEAD:  # the exporter may name the shared tensor after the head
            ck = TIED_SOURCE
        users = consumers.get(name, [])
        if len(users) == 1 and _perm(users[0]) == [1, 0]:
            plan.append(Initializer(users[0].output[0], ck, True, shapes[name][::-1]))
            drop.add(id(users[0]))
        else:
            plan.append(Initializer(name, ck, False, shapes[name]))
    _keep_nodes(g, [n for n in g.node if id(n) not in drop])
    weights = set(weight_names)
    inputs = [i for i in g.input if i.name not in weights]
    del g.input[:]
    g.input.extend(inputs)
    return plan


def _perm(node) -> list[int] | None:
    if node.op_type != "Transpose":
        return None
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def _keep_nodes(graph, nodes: list) -> None:
    kept = list(nodes)  # copies: clearing the repeated field would invalidate references into it
    copies = []
    for n in kept:
        c = type(n)()
        c.CopyFrom(n)
        copies.append(c)
    del graph.node[:]
    graph.node.extend(copies)


# ------------------------------------------------------------------------------------ the weights
class DataFile:
    """An external-data file being appended to: each tensor at an aligned offset, referenced by an
    EXTERNAL TensorProto (location = the file's name, so the folder can be moved as a whole)."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.offset = 0

    def add_bytes(self, name: str, data_type: int, dims, raw) -> object:
        import onnx

        raw = memoryview(raw).cast("B")
        a = PAGE if raw.nbytes >= ALIGN_THRESHOLD else SMALL_ALIGN
        start = (self.offset + a - 1) // a * a
        self._f.write(b"\0" * (start - self.offset))
        self._f.write(raw)
        self.offset = start + raw.nbytes
        tp = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims), data_location=onnx.TensorProto.EXTERNAL)
        for k, v in (("location", self.path.name), ("offset", str(start)), ("length", str(raw.nbytes))):
            e = tp.external_data.add()
            e.key, e.value = k, v
        return tp

    def add_array(self, name: str, arr: np.ndarray):
        from onnx.helper import np_dtype_to_tensor_dtype

        arr = np.ascontiguousarray(arr)
        return self.add_bytes(name, np_dtype_to_tensor_dtype(arr.dtype), arr.shape, arr)

    def add_proto(self, tp):
        """A TensorProto made by onnxruntime's quantizer (bytes in raw_data) moved to this file."""
        from onnx import numpy_helper

        raw = tp.raw_data if tp.HasField("raw_data") else np.ascontiguousarray(numpy_helper.to_array(tp)).tobytes()
        return self.add_bytes(tp.name, tp.data_type, tp.dims, raw)

    def close(self) -> None:
        self._f.close()


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class Weights:
    """The checkpoint's tensors, read one at a time as fp32 numpy in ONNX layout. Read with plain
    reads, not safetensors' memory map: a map kept open would leave every page it ever touched in
    the process's RSS (the whole model by the end), on top of the ONNX Runtime session that checks
    the export."""

    def __init__(self, weights_file: Path):
        self.file = Path(weights_file)
        with open(self.file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self._base = 8 + n
        self._index = {k: v for k, v in header.items() if k != "__metadata__"}

    def tensor(self, name: str) -> torch.Tensor:
        e = self._index.get(name)
        if e is None or e["dtype"] not in SAFETENSORS_DTYPES:
            raise OnnxExportError(f"{self.file}: no fp32/fp16/bf16 tensor {name}")
        start, end = e["data_offsets"]
        buf = bytearray(end - start)
        with open(self.file, "rb") as f:
            f.seek(self._base + start)
            if f.readinto(buf) != len(buf):
                raise OnnxExportError(f"{self.file}: truncated (tensor {name} is cut off)")
        return torch.frombuffer(buf, dtype=SAFETENSORS_DTYPES[e["dtype"]]).reshape(e["shape"]).float()

    def names(self) -> list[str]:
        return list(self._index)

    def get(self, item: Initializer) -> np.ndarray:
        arr = self.tensor(item.checkpoint_name).numpy()
        arr = np.ascontiguousarray(arr.T if item.transpose else arr, dtype="<f4")
        if tuple(arr.shape) != item.shape:
            raise OnnxExportError(f"{item.checkpoint_name}: shape {tuple(arr.shape)} in the checkpoint, "
                                  f"{item.shape} in the graph")
        return arr


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
                if src is not None and _perm(node) == [1, 0]:
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
            _keep_nodes(g, out_nodes)
            g.initializer.extend(data.add_array(i.onnx_name, weights.get(i)) for i in plan if i.onnx_name in used)
            if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
                proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    finally:
        data.close()
    model_path.write_bytes(proto.SerializeToString())
    return data.offset


# ------------------------------------------------------------------------------------ the checks
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
            ref = _Decoder(model)(*args)
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
    meta = onnx_config(src, variants, opset=next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
                       checks=checks, timings=timings, sizes=sizes)
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [*written, folder / TOKENIZER_FILE, folder / CONFIG_FILE]


def onnx_config(src, variants: list[str], *, opset: int, checks: dict, timings: dict, sizes: dict) -> dict:
    """onnx_config.json: what serving.onnxrt, export.genai and parity read."""
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
    names = [CONFIG_FILE, TOKENIZER_FILE] + [n for f in VARIANT_FILES.values() for n in (f, data_file(f))]
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
    out_dir/genai/<variant>/ for ONNX Runtime GenAI, export.genai)."""
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

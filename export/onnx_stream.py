"""ONNX export that scales: the graph traced once over placeholder weights, the real weights
streamed from the checkpoint into external data, one tensor at a time.

`torch.onnx.export(dynamo=True)` over a real model holds several copies of the weights (the module,
torch.export's constants, the ONNX IR, the optimizer's folded transposes, the serialized proto) and
its time grows with the weights: 384 s and 5.4x the fp32 size in RSS for the `400m` preset.
Here the weights never enter the exporter:

1. the model is built on the meta device and every parameter replaced by a zero-stride view of one
   scalar (`torch.zeros(()).expand(shape)`): real shapes, 4 bytes of storage; the tied head stays
   one parameter;
2. torch.onnx's TorchScript exporter traces it with `export_params=False` (the weights become
   graph inputs and are never serialized) and without constant folding (which would materialize
   transposed placeholders): seconds for 32 layers, where the dynamo exporter spends minutes;
3. `model.onnx` gets the graph and, per initializer, an external-data reference into
   `model.onnx.data`, which is written by streaming each tensor from `model.safetensors`
   (memory-mapped); a weight consumed only through Transpose(perm=1,0) is written transposed and
   the Transpose dropped (as the regular exporter's constant folding does), so every projection is
   `MatMul(x, W^T)` with an initializer weight;
4. the export's own check runs ONNX Runtime on probe shapes unlike the traced ones, frees the
   session, then loads the PyTorch model and compares (the two never coexist in memory).

Peak RSS is then one ONNX Runtime session or one PyTorch model, plus the interpreter. The graph is
the same function as export.onnx's (same inputs/outputs, same ops up to constant folding), so
serving.onnxrt and parity read it unchanged; the weights always go to external data.
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from export.onnx import (
    EXPORT_TOLERANCE,
    EXTERNAL_DATA_SUFFIX,
    PROBE_TEXT,
    TRACE_BATCH,
    TRACE_PAST,
    TRACE_SEQ,
    OnnxExportError,
    _Decoder,
    _example_inputs,
)
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
from training.model import ModelConfig, Transformer

WRAPPER_PREFIX = "model."  # _Decoder holds the Transformer as `.model`: initializer names carry it
# Large tensors start at a page boundary in the data file, so ONNX Runtime can memory-map them
# (onnx's own external-data writer uses the same rule).
ALIGN_THRESHOLD = 1 << 20
PAGE = 4096
SMALL_ALIGN = 64
TIED_HEAD, TIED_SOURCE = "output.weight", "tok_embeddings.weight"  # the checkpoint stores a tied head once
GRAPH_OPSET = 18  # every op of the decoder exists there; ONNX Runtime and GenAI run it
CHECK_SHAPES = ((2, 4, 0), (2, 1, 3))  # (batch, sequence, past): unlike the traced (3, 5, 7)


@dataclass(frozen=True)
class Initializer:
    onnx_name: str  # the name in the written graph
    checkpoint_name: str  # the tensor in model.safetensors
    transpose: bool  # written as W^T (its Transpose node dropped)
    shape: tuple[int, ...]  # as written


# ------------------------------------------------------------------------------------ the graph
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
    """The same symbolic axes as export.onnx's torch.export Dims, in the TorchScript exporter's form."""
    ins, outs = input_names(n_layers), output_names(n_layers)
    axes = {ins[0]: {0: "batch", 1: "sequence_length"}, ins[1]: {0: "batch", 1: "total_sequence_length"},
            ins[2]: {0: "batch", 1: "sequence_length"}, outs[0]: {0: "batch", 1: "sequence_length"}}
    axes.update({n: {0: "batch", 2: "past_sequence_length"} for n in ins[3:]})
    axes.update({n: {0: "batch", 2: "total_sequence_length"} for n in outs[1:]})
    return axes


def export_graph(cfg: ModelConfig, opset: int | None = None):
    """The decoder graph as an onnx.ModelProto whose weights are graph inputs named by their
    parameter names (`model.layers.0.attention.wq.weight`, ...); returns (proto, weight names).

    torch.onnx's TorchScript exporter with `export_params=False` (weights become inputs, never
    serialized) and no constant folding (which would materialize transposed placeholders): a
    32-layer graph in seconds, where the dynamo exporter spends minutes tracing."""
    import onnx

    model = placeholder_model(cfg)

    class _Cfg:  # _example_inputs only reads .cfg
        pass

    holder = _Cfg()
    holder.cfg = cfg
    n = cfg.n_layers
    with tempfile.TemporaryDirectory() as td, warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore")
        path = Path(td) / "graph.onnx"
        torch.onnx.export(_Decoder(model), _example_inputs(holder, TRACE_BATCH, TRACE_SEQ, TRACE_PAST), str(path),
                          input_names=input_names(n), output_names=output_names(n), dynamic_axes=_dynamic_axes(n),
                          opset_version=opset or GRAPH_OPSET, export_params=False, do_constant_folding=False,
                          dynamo=False)
        proto = onnx.load(str(path))
    fixed = set(input_names(n))
    weights = [i.name for i in proto.graph.input if i.name not in fixed]
    return proto, weights


def plan_initializers(proto, weight_names: list[str], cfg: ModelConfig) -> list[Initializer]:
    """Turn the weight inputs back into initializers. A weight whose only consumers are
    Transpose(perm=[1,0]) nodes is written transposed under the Transpose's output name and those
    nodes are removed; others (the tied embedding: a Gather and the head's Transpose) stay as they
    are."""
    g = proto.graph
    shapes = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in g.input}
    consumers: dict[str, list] = {}
    for node in g.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
    plan: list[Initializer] = []
    drop = []
    for name in weight_names:
        if name not in shapes:  # optimized away (unused)
            continue
        ck = name[len(WRAPPER_PREFIX):] if name.startswith(WRAPPER_PREFIX) else name
        if cfg.tie_embeddings and ck == TIED_HEAD:  # the exporter may name the shared tensor after the head
            ck = TIED_SOURCE
        users = consumers.get(name, [])
        perms = [next((list(a.ints) for a in u.attribute if a.name == "perm"), None) for u in users
                 if u.op_type == "Transpose"]
        if users and len(perms) == len(users) and all(p == [1, 0] for p in perms) and len(users) == 1:
            t = users[0]
            plan.append(Initializer(t.output[0], ck, True, shapes[name][::-1]))
            drop.append(t)
        else:
            plan.append(Initializer(name, ck, False, shapes[name]))
    kept = [n for n in g.node if all(n is not d for d in drop)]
    del g.node[:]
    g.node.extend(kept)
    weight_set = set(weight_names)
    inputs = [i for i in g.input if i.name not in weight_set]
    del g.input[:]
    g.input.extend(inputs)
    return plan


# ------------------------------------------------------------------------------------ the weights
def _aligned(offset: int, nbytes: int) -> int:
    a = PAGE if nbytes >= ALIGN_THRESHOLD else SMALL_ALIGN
    return (offset + a - 1) // a * a


def stream_weights(proto, plan: list[Initializer], weights_file: Path, data_path: Path) -> int:
    """Write every planned tensor into `data_path` (one at a time, memory-mapped from safetensors)
    and add its external-data TensorProto to the graph. Returns the bytes written."""
    import onnx
    from safetensors import safe_open

    offset = 0
    with open(data_path, "wb") as out, safe_open(str(weights_file), framework="pt") as st:
        available = set(st.keys())
        for item in plan:
            if item.checkpoint_name not in available:
                raise OnnxExportError(f"{weights_file}: no tensor {item.checkpoint_name} for ONNX initializer {item.onnx_name}")
            t = st.get_tensor(item.checkpoint_name).to(torch.float32)
            arr = t.numpy()
            if item.transpose:
                arr = arr.T
            arr = np.ascontiguousarray(arr, dtype="<f4")
            if tuple(arr.shape) != item.shape:
                raise OnnxExportError(f"{item.checkpoint_name}: shape {tuple(arr.shape)} in the checkpoint, "
                                      f"{item.shape} in the graph")
            start = _aligned(offset, arr.nbytes)
            out.write(b"\0" * (start - offset))
            out.write(memoryview(arr).cast("B"))
            offset = start + arr.nbytes
            tp = onnx.TensorProto(name=item.onnx_name, data_type=onnx.TensorProto.FLOAT, dims=list(arr.shape),
                                  data_location=onnx.TensorProto.EXTERNAL)
            for k, v in (("location", data_path.name), ("offset", str(start)), ("length", str(arr.nbytes))):
                e = tp.external_data.add()
                e.key, e.value = k, v
            proto.graph.initializer.append(tp)
            del t, arr
    return offset


# ------------------------------------------------------------------------------------ the checks
@contextmanager
def _session(path: Path, threads: int | None = None) -> Iterator:
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
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


def _torch_model(source: Path, cfg: ModelConfig) -> Transformer:
    """The fp32 model with the checkpoint's tensors as its parameters (built on the meta device,
    weights assigned, not copied): one copy in memory, where load_model holds an initialized model
    and the loaded weights at once."""
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = Transformer(cfg)
    weights = load_file(str(Path(source) / layout.MODEL_WEIGHTS))
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False, assign=True)
    del weights
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise OnnxExportError(f"{source}: checkpoint lacks {missing[0]}")
    return model.eval()


def check_against_torch(path: Path, source: Path, cfg: ModelConfig) -> dict:
    """ONNX Runtime first (outputs kept, session freed), then PyTorch: never both models at once."""
    n = cfg.n_layers

    class _Cfg:
        pass

    holder = _Cfg()
    holder.cfg = cfg
    cases = [_example_inputs(holder, b, s, p, seed=1) for b, s, p in CHECK_SHAPES]
    with _session(path) as sess:
        got = [sess.run(output_names(n), {k: a.numpy() for k, a in zip(input_names(n), args, strict=True)})
               for args in cases]
    del sess  # the `with` name outlives the block: without this the session (its weights) stays alive
    model = _torch_model(source, cfg)
    worst = 0.0
    with torch.no_grad():
        for args, outs in zip(cases, got, strict=True):
            ref = _Decoder(model.float().eval())(*args)
            worst = max(worst, *(float(np.abs(o - r.numpy()).max()) for o, r in zip(outs, ref, strict=True)))
    del model
    if not worst <= EXPORT_TOLERANCE:
        raise OnnxExportError(f"{path}: ONNX Runtime disagrees with PyTorch (max |diff| {worst:.3g} > "
                              f"{EXPORT_TOLERANCE}); the streamed export is wrong")
    return {"max_abs_diff_vs_torch": worst}


# ------------------------------------------------------------------------------------ the export
def export_onnx_streamed(src, out_dir: Path, *, force: bool = False, opset: int | None = None,
                         check: bool = True) -> list[Path]:
    """fp32 ONNX of `src` (an export.manifest.Source) into `out_dir`: model.onnx (graph),
    model.onnx.data (weights), tokenizer.model, onnx_config.json. Returns the files written."""
    import onnx

    out_dir = Path(out_dir)
    fp32 = out_dir / VARIANT_FILES["fp32"]
    data = fp32.with_name(fp32.name + EXTERNAL_DATA_SUFFIX)
    targets = [fp32, data, out_dir / TOKENIZER_FILE, out_dir / CONFIG_FILE]
    existing = [p for p in targets if p.exists()]
    if existing and not force:
        raise OnnxExportError(f"{existing[0]} already exists; pass --force to overwrite")
    cfg = src.config
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).unlink(missing_ok=True)  # the config marks a complete export: it goes first
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    proto, weights = export_graph(cfg, opset)
    timings["graph_export_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = plan_initializers(proto, weights, cfg)
    tmp_data = data.with_name(f".{data.name}.tmp")
    tmp_model = fp32.with_name(f".{fp32.name}.tmp")
    try:
        nbytes = stream_weights(proto, plan, src.path / layout.MODEL_WEIGHTS, tmp_data)
        # the proto names its data file; the rename below gives it that name
        for init in proto.graph.initializer:
            for e in init.external_data:
                if e.key == "location":
                    e.value = data.name
        tmp_model.write_bytes(proto.SerializeToString())
        data.unlink(missing_ok=True)
        tmp_data.replace(data)
        tmp_model.replace(fp32)
    finally:
        tmp_data.unlink(missing_ok=True)
        tmp_model.unlink(missing_ok=True)
    timings["weights_stream_s"] = time.perf_counter() - t0
    onnx.checker.check_model(str(fp32), full_check=True)
    checks = {}
    if check:
        t0 = time.perf_counter()
        checks["fp32"] = check_against_torch(fp32, src.path, cfg)
        timings["check_s"] = time.perf_counter() - t0
    src.tokenizer.save(out_dir / TOKENIZER_FILE)
    meta = onnx_config(src, opset=next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
                       checks=checks, timings=timings, external_bytes=nbytes)
    (out_dir / CONFIG_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [fp32, data, out_dir / TOKENIZER_FILE, out_dir / CONFIG_FILE]


def onnx_config(src, *, opset: int, checks: dict, timings: dict, external_bytes: int) -> dict:
    """onnx_config.json, the keys serving.onnxrt reads (same as export.onnx writes)."""
    import onnx
    import onnxruntime

    cfg, tok = src.config, src.tokenizer
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
        "inputs": input_names(cfg.n_layers), "outputs": output_names(cfg.n_layers),
        "padding_side": PADDING_SIDE,
        "files": {"fp32": VARIANT_FILES["fp32"]},
        "external_data": True, "external_data_bytes": external_bytes, "exporter": "streamed", "opset": opset,
        "tokenizer_file": TOKENIZER_FILE, "tokenizer_sha256": tok.sha256,
        "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id,
        "im_start_id": tok.im_start_id, "im_end_id": tok.im_end_id, "eos_ids": [tok.eos_id, tok.im_end_id],
        "checks": {**checks, "probe_text": PROBE_TEXT[:16] + "..."},
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        "source": {"checkpoint": str(src.path), "step": src.step},
    }


def build_parser():
    from training.cli import ArgumentParser
    from training.schema import NonNegInt, flag

    ap = ArgumentParser(prog="python -m export.onnx_stream", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--out", type=Path, help="ONNX folder (default RUN_DIR/export/onnx)")
    ap.add_argument("--step", type=flag(NonNegInt))
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the ONNX Runtime vs PyTorch check")
    ap.add_argument("--debug", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    """python -m export.onnx_stream RUN_DIR|CHECKPOINT_DIR [--out DIR] [--step N] [--force] [--no-check]"""
    from export.manifest import default_out_dir, load_source
    from training.cli import run_main

    def run(args) -> None:
        if args.out is not None and args.out.exists() and not args.out.is_dir():
            raise OnnxExportError(f"--out {args.out}: exists and is not a folder")
        src = load_source(args.path, args.step)
        out = args.out or default_out_dir(src) / layout.ONNX_DIR
        t0 = time.perf_counter()
        for p in export_onnx_streamed(src, out, force=args.force, check=not args.no_check):
            print(f"wrote {p} ({p.stat().st_size / 2**20:.1f} MiB)")
        print(f"  in {time.perf_counter() - t0:.1f} s")

    return run_main(build_parser(), argv, run)


if __name__ == "__main__":
    raise SystemExit(main())

"""The ONNX exporter's graph builder: the decoder traced over a weightless placeholder model
(export.onnx.onnx_export's steps 1-2), and its weight inputs turned back into a plan of initializers (step 3's
layout: which checkpoint tensor, transposed or not). export.onnx.onnx_export streams the weights into it."""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from serving.backends.onnxrt_backend import input_names, output_names
from training.model.decoder import ModelConfig, Transformer

# Example shapes the graph is traced at: distinct and >= 2, so none is taken for a constant.
TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 3, 5, 7
GRAPH_OPSET = 18  # every op of the decoder exists there; ONNX Runtime and GenAI run it
TIED_HEAD, TIED_SOURCE = "output.weight", "tok_embeddings.weight"  # the checkpoint stores a tied head once
WRAPPER_PREFIX = "model."  # Decoder holds the Transformer as `.model`: initializer names carry it


class Decoder(nn.Module):
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
        torch.onnx.export(Decoder(placeholder_model(cfg)), example_inputs(cfg, TRACE_BATCH, TRACE_SEQ, TRACE_PAST),
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
        if len(users) == 1 and transpose_perm(users[0]) == [1, 0]:
            plan.append(Initializer(users[0].output[0], ck, True, shapes[name][::-1]))
            drop.add(id(users[0]))
        else:
            plan.append(Initializer(name, ck, False, shapes[name]))
    set_nodes(g, [n for n in g.node if id(n) not in drop])
    weights = set(weight_names)
    inputs = [i for i in g.input if i.name not in weights]
    del g.input[:]
    g.input.extend(inputs)
    return plan


def transpose_perm(node) -> list[int] | None:
    if node.op_type != "Transpose":
        return None
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def set_nodes(graph, nodes: list) -> None:
    kept = list(nodes)  # copies: clearing the repeated field would invalidate references into it
    copies = []
    for n in kept:
        c = type(n)()
        c.CopyFrom(n)
        copies.append(c)
    del graph.node[:]
    graph.node.extend(copies)

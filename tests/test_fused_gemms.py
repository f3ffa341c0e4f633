"""Fused projections (#27 item 6): q/k/v as one GEMM against cat([wq, wk, wv]) and gate/up as one
against cat([w1, w3]) equal the three (two) nn.Linear calls, with the same parameters and state_dict,
and fusion steps aside wherever something expects to see each Linear called: hooks (the PyTorch
importance matrix, export.gguf.imatrix_torch), a replaced forward (tests/gates_plants.py's dead rows), a
Linear subclass, and ONNX export (one MatMul per named weight, export.onnx.onnx_graph's initializer plan).

On CPU the fused path is off by default (training.model.decoder.FUSE_DEVICES: measured slower there,
docs/scale.md "Fused projections"); these tests switch it on for CPU to run it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import training.model.decoder as M
from training.gates.model_gates import TOLERANCE
from training.model.decoder import Transformer, fuse_gemms, plain_linear, preset

# Relative L2 error ||fused - unfused|| / ||unfused||, fp32 on CPU. Measured (tiny preset, 2 x 150
# tokens): logits 0.0 (each output column is the same dot product either way), gradients 5.1e-7 at
# worst (layers.0.attention.wq.weight): the input gradient of one GEMM over [gate|up] (or [q|k|v])
# sums its 2 x ffn_dim products in another order than autograd adding two (three) GEMMs' results, and
# that reaches every gradient before it. The bound is that of a reordered fp32 sum of K = 2 x ffn_dim
# = 1536 terms, sqrt(K) * eps(fp32) = 4.7e-6.
FP32_REL_TOL = (2 * preset("tiny").ffn_dim) ** 0.5 * torch.finfo(torch.float32).eps
ROWS = 300  # >= FUSE_MIN_ROWS: the fused path runs


@pytest.fixture
def fused_on_cpu(monkeypatch):
    monkeypatch.setattr(M, "FUSE_DEVICES", ("cpu",))


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("tiny", n_layers=2))


def batch(cfg, rows: int = ROWS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (2, rows // 2), generator=g)
    y = torch.randint(0, cfg.vocab_size, (2, rows // 2), generator=g)
    return x, y


def logits_and_grads(model: Transformer, x, y):
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y, return_logits=True)
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Spy:
    """Counts calls of fused_linear (did the fused path run?)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = M.fused_linear

        def spy(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(M, "fused_linear", spy)


def test_fused_equals_unfused_logits_and_gradients(fused_on_cpu, monkeypatch):
    model = tiny_model()
    x, y = batch(model.cfg)
    spy = Spy(monkeypatch)
    fused = logits_and_grads(model, x, y)
    assert spy.calls == 2 * model.cfg.n_layers  # qkv and gate/up in each block, every one fused
    monkeypatch.setattr(M, "FUSE_DEVICES", ())
    plain = logits_and_grads(model, x, y)
    assert spy.calls == 2 * model.cfg.n_layers  # nothing more fused
    assert rel(fused[0], plain[0]) <= FP32_REL_TOL
    worst = max(((rel(fused[1][n], g), n) for n, g in plain[1].items()))
    assert worst[0] <= FP32_REL_TOL, worst
    assert fused[1].keys() == plain[1].keys()


def test_fused_under_autocast_matches_within_bf16_rounding(fused_on_cpu, monkeypatch):
    """Under bf16 autocast the weights are cast before the cat: the GEMM runs in bf16 like nn.Linear's."""
    model = tiny_model()
    x, y = batch(model.cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = logits_and_grads(model, x, y)
        monkeypatch.setattr(M, "FUSE_DEVICES", ())
        plain = logits_and_grads(model, x, y)
    assert fused[0].dtype == plain[0].dtype == torch.bfloat16
    # measured: logits 0.0, gradients 7.8e-3 at worst (layers.0.attention.wk.weight; the fused input
    # gradient is one bf16 rounding of the summed products, the unfused one adds three bf16 roundings)
    tol_logits, tol_grads = TOLERANCE["bf16"]
    assert rel(fused[0], plain[0]) <= tol_logits
    worst = max(((rel(fused[1][n], g), n) for n, g in plain[1].items()))
    assert worst[0] <= tol_grads, worst
    assert all(fused[1][n].dtype == torch.float32 for n in fused[1])


def test_state_dict_and_parameters_unchanged(fused_on_cpu):
    model = tiny_model()
    before = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    x, y = batch(model.cfg)
    logits_and_grads(model, x, y)
    after = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    assert before == after
    block = {k.removeprefix("layers.0.") for k in after if k.startswith("layers.0.")}
    assert block == {"attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                     "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                     "feed_forward.w3.weight"}


def test_small_batches_and_other_devices_stay_unfused(monkeypatch):
    lin = nn.Linear(8, 8, bias=False)
    monkeypatch.setattr(M, "FUSE_DEVICES", ("cpu",))
    assert fuse_gemms(torch.zeros(1, M.FUSE_MIN_ROWS, 8), lin, lin)
    assert not fuse_gemms(torch.zeros(1, M.FUSE_MIN_ROWS - 1, 8), lin, lin)  # decode: the cat would not pay
    monkeypatch.setattr(M, "FUSE_DEVICES", ("cuda",))
    assert not fuse_gemms(torch.zeros(1, M.FUSE_MIN_ROWS, 8), lin, lin)


def test_anything_that_watches_a_linear_turns_fusion_off():
    lin = nn.Linear(8, 8, bias=False)
    assert plain_linear(lin)
    assert not plain_linear(nn.Linear(8, 8, bias=True))
    h = lin.register_forward_pre_hook(lambda m, i: None)
    assert not plain_linear(lin)
    h.remove()
    h = lin.register_forward_hook(lambda m, i, o: None)
    assert not plain_linear(lin)
    h.remove()
    h = lin.register_full_backward_hook(lambda m, gi, go: None)
    assert not plain_linear(lin)
    h.remove()
    assert plain_linear(lin)
    lin.forward = lambda x: x  # a plant or a debugger replaced the instance's forward
    assert not plain_linear(lin)

    class MyLinear(nn.Linear):
        pass

    assert not plain_linear(MyLinear(8, 8, bias=False))
    x = torch.zeros(M.FUSE_MIN_ROWS, 8)
    g = nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    try:
        assert not fuse_gemms(x, nn.Linear(8, 8, bias=False))
    finally:
        g.remove()


def test_importance_hooks_see_every_projection_with_fusion_on(fused_on_cpu, monkeypatch):
    """export.gguf.imatrix_torch hooks each nn.Linear; fusion would silently skip wq/wk/wv/w1/w3 (their
    entries missing, or wrong) if it ignored the hooks. With hooks attached the model runs unfused, so
    the sums equal those of a run with fusion off, for every Linear."""
    from export.gguf.imatrix_torch import _Importance, _pass_over

    model = tiny_model()
    chunks = [list(range(1, ROWS + 1))]

    def sums(fisher: bool) -> dict:
        imp = _Importance(fisher)
        imp.attach(model, None)
        try:
            _pass_over(model, chunks, fisher)
        finally:
            imp.detach()
        return {g: s.clone() for g, s in imp.sums.items()}

    expected_names = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.ffn_gate.weight",
                      "blk.0.ffn_up.weight", "blk.1.attn_q.weight", "blk.1.ffn_up.weight"}
    spy = Spy(monkeypatch)
    for fisher in (False, True):
        got = sums(fisher)
        assert expected_names <= got.keys()
        assert spy.calls == 0  # hooks attached: every projection ran as its own module
        monkeypatch.setattr(M, "FUSE_DEVICES", ())
        want = sums(fisher)
        monkeypatch.setattr(M, "FUSE_DEVICES", ("cpu",))
        assert got.keys() == want.keys()
        for g in want:
            assert torch.equal(got[g], want[g]), g
    # and the model fuses again once the hooks are gone
    model(torch.tensor(chunks))
    assert spy.calls == 2 * model.cfg.n_layers


def test_the_importance_test_catches_fusion_that_ignores_hooks(fused_on_cpu, monkeypatch):
    """The defect the check above guards against, planted: fusion that looks only at the module type
    makes the importance matrix lose every fused projection, silently."""
    from export.gguf.imatrix_torch import _Importance, _pass_over

    monkeypatch.setattr(M, "plain_linear", lambda m: type(m) is nn.Linear)
    model = tiny_model()
    imp = _Importance(False)
    imp.attach(model, None)
    try:
        _pass_over(model, [list(range(1, ROWS + 1))], False)
    finally:
        imp.detach()
    assert "blk.0.attn_q.weight" not in imp.sums and "blk.0.ffn_up.weight" not in imp.sums
    assert "blk.0.attn_output.weight" in imp.sums  # wo and w2 are never fused


def test_dead_rows_plant_still_runs_with_fusion_on(fused_on_cpu, monkeypatch):
    """tests/gates_plants.py replaces wq's forward on the instance; the fused path must not bypass it."""
    from gates_plants import dead_rows

    model = tiny_model()
    name = dead_rows(model)
    spy = Spy(monkeypatch)
    x, y = batch(model.cfg)
    _, grads = logits_and_grads(model, x, y)
    assert spy.calls == 2 * model.cfg.n_layers - 1  # layer 0's q/k/v unfused, the rest fused
    assert (grads[name].abs().sum(-1) == 0).any()  # the plant's dead rows reached the gradient


def test_onnx_export_keeps_one_matmul_per_weight(fused_on_cpu, monkeypatch):
    """export.onnx.onnx_graph traces the model (TorchScript exporter): with fusion forced on for every size,
    the graph is the same as with fusion off: no Concat of weights, each weight transposed into its own
    MatMul and written as its own named initializer."""
    pytest.importorskip("onnx")
    from export.onnx.onnx_graph import export_graph, plan_initializers

    cfg = preset("tiny", n_layers=1)
    monkeypatch.setattr(M, "FUSE_MIN_ROWS", 1)

    def graph():
        proto, names = export_graph(cfg)
        plan = plan_initializers(proto, names, cfg)
        return sorted(n.op_type for n in proto.graph.node), sorted((i.checkpoint_name, i.transpose) for i in plan)

    fused_try = graph()
    monkeypatch.setattr(M, "FUSE_DEVICES", ())
    assert fused_try == graph()
    plan = dict(fused_try[1])
    assert plan["layers.0.attention.wq.weight"] and plan["layers.0.feed_forward.w3.weight"]  # transposed: own MatMul


def test_compiled_block_has_no_graph_break(fused_on_cpu):
    """The checks run under torch.compile (training.distributed.compile_blocks) without a graph break."""
    model = tiny_model()
    block = model.layers[0]
    x = torch.randn(2, ROWS // 2, model.cfg.d_model)
    cos, sin = M.rope_cos_sin(torch.arange(ROWS // 2), model.cfg.head_dim, model.cfg.rope_theta)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    got, _ = compiled(x, cos, sin)
    want, _ = block(x, cos, sin)
    assert rel(got, want) <= FP32_REL_TOL

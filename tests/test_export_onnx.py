"""export.onnx.onnx_export: the decoder graph (fp32, int8, int4) against PyTorch, on a tiny model trained for real."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.onnx.onnx_export import OnnxExportError, export_onnx
from serving.backends.onnxrt_backend import input_names, output_names
from training.checkpoint.checkpoint_io import CheckpointError

# fixtures_onnx is both a plugin (session fixtures onnx_run, onnx_export, torch_model) and a helper module;
# registering it for assertion rewriting first lets pytest load the plugin after this import.
pytest.register_assert_rewrite("fixtures_onnx")
from fixtures_onnx import kl_mean, probe_ids  # noqa: E402

pytest_plugins = ("fixtures_onnx",)
EXACT = 1e-4  # fp32 ONNX vs PyTorch, max |logit diff|
# Mean KL(fp32 || quantized) on the probe and top-1 agreement, ~3x the measured values (#32: the tiny
# run's model, step 272 of 300, onnxruntime CPU): KL int8 8.3e-5, int4 2.6e-3 (the exporter's own probe:
# 8.2e-5 / 1.1e-3); top-1 int8 1.000, int4 0.967 (29 of 30 positions). An int4 at README's regressed
# 87.8 % top-1 fails.
INT8_KL, INT4_KL = 2.5e-4, 8e-3
TOP1 = {"int8": 0.95, "int4": 0.9}


def size(model: Path) -> int:
    """A model file with its external data."""
    return model.stat().st_size + model.with_name(model.name + "_data").stat().st_size


def session(path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run(sess, cfg, ids, mask, pos, past=None):
    b = ids.shape[0]
    names = input_names(cfg.n_layers)
    if past is None:
        past = [np.zeros((b, cfg.n_kv_heads, 0, cfg.head_dim), np.float32)] * (2 * cfg.n_layers)
    feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64),
            "position_ids": pos.astype(np.int64), **dict(zip(names[3:], past, strict=True))}
    out = sess.run(output_names(cfg.n_layers), feed)
    return out[0], out[1:]


def test_files_config_and_checker(onnx_export, torch_model):
    out, files = onnx_export
    model, ck = torch_model
    cfg = model.cfg
    names = {p.name for p in files}
    models = {"model.onnx", "model-int8.onnx", "model-int4.onnx"}
    # the weights as optimum and transformers.js name them (model.onnx_data), the HF files transformers.js reads
    hub = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert names == models | {m + "_data" for m in models} | {"tokenizer.model", "onnx_config.json"} | hub
    assert files[-1].name == "onnx_config.json"  # written last: it marks a complete export
    assert all(p.is_file() for p in files)
    meta = json.loads((out / "onnx_config.json").read_text())
    assert (meta["n_layers"], meta["n_kv_heads"], meta["head_dim"], meta["vocab_size"]) == (
        cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert meta["model_config"] == cfg.to_dict()
    assert meta["tokenizer_sha256"] == ck.tokenizer.sha256
    assert (meta["bos_id"], meta["eos_id"], meta["im_end_id"]) == (
        ck.tokenizer.bos_id, ck.tokenizer.eos_id, ck.tokenizer.im_end_id)
    assert (out / "tokenizer.model").read_bytes() == ck.tokenizer.proto
    for f in ("model.onnx", "model-int8.onnx", "model-int4.onnx"):
        onnx.checker.check_model(str(out / f), full_check=True)


def test_io_names_and_dynamic_axes(onnx_export, torch_model):
    out, _ = onnx_export
    cfg = torch_model[0].cfg
    g = onnx.load(str(out / "model.onnx")).graph
    assert [i.name for i in g.input] == input_names(cfg.n_layers)
    assert [o.name for o in g.output] == output_names(cfg.n_layers)
    assert input_names(2)[3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert output_names(2)[1:3] == ["present.0.key", "present.0.value"]

    def dims(vi):
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    by = {v.name: dims(v) for v in list(g.input) + list(g.output)}
    assert by["input_ids"] == ["batch", "sequence_length"]
    assert by["attention_mask"][0] == "batch" and isinstance(by["attention_mask"][1], str)
    assert by["past_key_values.0.key"] == ["batch", cfg.n_kv_heads, "past_sequence_length", cfg.head_dim]
    assert by["logits"] == ["batch", "sequence_length", cfg.vocab_size]
    present = by["present.1.value"]
    assert present[0] == "batch" and isinstance(present[2], str) and present[3] == cfg.head_dim


def test_fp32_full_sequence_equals_torch(onnx_export, torch_model):
    out, _ = onnx_export
    model, ck = torch_model
    ids = np.array([probe_ids(ck.tokenizer)])
    logits, presents = run(session(out / "model.onnx"), model.cfg, ids, np.ones_like(ids), np.arange(ids.shape[1])[None])
    with torch.no_grad():
        ref = model(torch.from_numpy(ids))[0].numpy()  # the training path, not the cache path
        _, ref_presents = model.forward_with_cache(torch.from_numpy(ids), torch.arange(ids.shape[1])[None], None)
    assert logits.dtype == np.float32 and logits.shape == (1, ids.shape[1], model.cfg.vocab_size)
    assert np.abs(logits[0] - ref).max() <= EXACT
    assert np.abs(presents[-1] - ref_presents[-1][1].numpy()).max() <= EXACT
    assert np.abs(ref).max() > 1.0  # a trained model: the comparison is not between near-zero numbers


def test_fp32_incremental_equals_torch(onnx_export, torch_model):
    """Prompt in two chunks, then one token at a time, feeding present -> past."""
    out, _ = onnx_export
    model, ck = torch_model
    cfg = model.cfg
    ids = np.array([probe_ids(ck.tokenizer)])
    n = ids.shape[1]
    sess = session(out / "model.onnx")
    first = 5
    rows, past = [], None
    logits, past = run(sess, cfg, ids[:, :first], np.ones((1, first)), np.arange(first)[None])
    rows.append(logits[0])
    for t in range(first, n):
        logits, past = run(sess, cfg, ids[:, t:t + 1], np.ones((1, t + 1)), np.array([[t]]), past)
        rows.append(logits[0])
    assert past[0].shape == (1, cfg.n_kv_heads, n, cfg.head_dim)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids))[0].numpy()
    assert np.abs(np.concatenate(rows) - ref).max() <= EXACT


@pytest.mark.parametrize("side", ["left", "right"])
def test_dynamic_batch_with_padding(onnx_export, torch_model, side):
    """B=2 rows of different lengths, padded, prompt then two decoding steps, vs each row alone in PyTorch."""
    out, _ = onnx_export
    model, ck = torch_model
    cfg = model.cfg
    rows = [probe_ids(ck.tokenizer)[:12], ck.tokenizer.encode("নদীর ধারে", bos=True)]
    length = max(map(len, rows))
    ids = np.full((2, length), ck.tokenizer.pad_id)
    mask, pos = np.zeros((2, length), np.int64), np.zeros((2, length), np.int64)
    spans = []
    for r, seq in enumerate(rows):
        sl = slice(0, len(seq)) if side == "right" else slice(length - len(seq), length)
        ids[r, sl], mask[r, sl], pos[r, sl] = seq, 1, np.arange(len(seq))
        spans.append(sl)
    sess = session(out / "model.onnx")
    logits, past = run(sess, cfg, ids, mask, pos)
    assert np.isfinite(logits).all()
    nxt = [[11, 12], [21, 22]]  # two more tokens per row, each at the row's own next position
    step_logits = []
    for k in range(2):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        step_pos = np.array([[len(rows[r]) + k] for r in range(2)])
        lg, past = run(sess, cfg, np.array([[nxt[0][k]], [nxt[1][k]]]), mask, step_pos, past)
        step_logits.append(lg[:, 0])
    with torch.no_grad():
        for r, seq in enumerate(rows):
            ref = model(torch.tensor([seq + nxt[r]]))[0].numpy()
            assert np.abs(logits[r, spans[r]] - ref[:len(seq)]).max() <= EXACT
            for k in range(2):
                assert np.abs(step_logits[k][r] - ref[len(seq) + k]).max() <= EXACT


def test_quantized_variants_close_to_fp32(onnx_export, torch_model):
    out, _ = onnx_export
    model, ck = torch_model
    cfg = model.cfg
    ids = np.array([probe_ids(ck.tokenizer)])
    mask, pos = np.ones_like(ids), np.arange(ids.shape[1])[None]
    ref, _ = run(session(out / "model.onnx"), cfg, ids, mask, pos)
    ops = {}
    for variant, limit in (("int8", INT8_KL), ("int4", INT4_KL)):
        path = out / f"model-{variant}.onnx"
        graph = onnx.load(str(path)).graph
        ops[variant] = {n.op_type for n in graph.node}
        weights = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
        fp32_weight_ops = [n.name for n in graph.node if n.op_type in ("MatMul", "Gather") and n.input[0 if
                           n.op_type == "Gather" else 1] in weights]
        assert not fp32_weight_ops, f"{variant}: weights left in fp32: {fp32_weight_ops}"  # the tied head too
        q, presents = run(session(path), cfg, ids, mask, pos)
        assert np.isfinite(q).all() and np.isfinite(presents[0]).all()
        kl = kl_mean(ref[0], q[0])
        top1 = float((ref[0].argmax(-1) == q[0].argmax(-1)).mean())
        print(f"{variant}: KL(fp32||{variant}) mean {kl:.2e}, top-1 agreement {top1:.3f}, "
              f"size {size(path) / 1e6:.2f} MB")
        assert 0 < kl <= limit  # quantized (not a copy) and still close
        assert top1 >= TOP1[variant]
    assert "MatMulInteger" in ops["int8"] or "DynamicQuantizeMatMul" in ops["int8"]
    assert "MatMulNBits" in ops["int4"] and "GatherBlockQuantized" in ops["int4"]
    assert size(out / "model-int4.onnx") < size(out / "model-int8.onnx") < size(out / "model.onnx")
    meta = json.loads((out / "onnx_config.json").read_text())
    assert meta["checks"]["int8"]["kl_mean"] <= INT8_KL and meta["checks"]["int4"]["kl_mean"] <= INT4_KL


def test_refuses_to_overwrite_without_force(onnx_export, onnx_run):
    out, _ = onnx_export
    before = (out / "model.onnx").stat().st_mtime_ns
    with pytest.raises(OnnxExportError, match="already exists"):
        export_onnx(onnx_run, out)
    assert (out / "model.onnx").stat().st_mtime_ns == before


def test_force_overwrites(onnx_export, onnx_run, tmp_path):
    src, _ = onnx_export
    out = tmp_path / "onnx"
    shutil.copytree(src, out)
    (out / "model.onnx").write_bytes(b"stale")
    (out / "model-int8.onnx.data").write_bytes(b"stale")  # an older export's name for the external data
    files = export_onnx(onnx_run, out, force=True)  # fp32 only this time
    assert sorted(p.name for p in files) == ["config.json", "generation_config.json", "model.onnx", "model.onnx_data",
                                             "onnx_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    onnx.checker.check_model(str(out / "model.onnx"))
    meta = json.loads((out / "onnx_config.json").read_text())
    assert meta["files"] == {"fp32": "model.onnx"} and meta["checks"]["fp32"]["max_abs_diff_vs_torch"] <= EXACT
    assert (out / "model.onnx_data").is_file() and not list(out.glob(".*"))  # no temporary left behind
    assert not [p for p in out.iterdir() if p.name.startswith(("model-int8", "model-int4"))]  # no stale variants


def test_bad_source_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        export_onnx(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        export_onnx(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failure_midway_leaves_the_old_export_untouched(onnx_export, onnx_run, tmp_path, monkeypatch):
    """Every file is written into a temporary folder and moved into place at the end: an export that
    fails after writing fp32 and int8 leaves the earlier export byte-identical, and no temporary."""
    import export.onnx.onnx_export as exporter

    src, _ = onnx_export
    out = tmp_path / "onnx"
    shutil.copytree(src, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def fail(*_args):  # the int4 quantizer breaks on its first tensor
        raise OnnxExportError("int4 quantizer failed")

    monkeypatch.setattr(exporter, "_quantize_int4", fail)
    with pytest.raises(OnnxExportError, match="int4 quantizer failed"):
        export_onnx(onnx_run, out, int8=True, int4=True, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx"]


def test_quantized_weights_are_streamed_one_tensor_at_a_time(onnx_run, tmp_path, monkeypatch):
    """The quantizers see one checkpoint tensor at a time, never the model: the largest array any of
    them is handed is the largest single weight (the embedding), and the fp32 ModelProto is never loaded."""
    import export.onnx.onnx_export as exporter
    from export.manifest import load_source

    src = load_source(onnx_run)
    largest = max(int(np.prod(s)) for s in src.shapes.values())
    seen: list[int] = []
    for name in ("_quantize_int8_matmul", "_quantize_int8_gather", "_quantize_int4"):
        real = getattr(exporter, name)

        def spy(node, w, data, real=real):
            seen.append(w.size)
            return real(node, w, data)

        monkeypatch.setattr(exporter, name, spy)
    real_load = onnx.load

    def load(f, *a, **k):  # only the traced graph (no weights) may be loaded
        assert Path(f).name == "graph.onnx", f"the exporter loaded a whole ONNX model: {f}"
        return real_load(f, *a, **k)

    monkeypatch.setattr(onnx, "load", load)
    files = export_onnx(src, tmp_path / "onnx", int8=True, int4=True)
    cfg = src.config
    assert len(seen) == 2 * (7 * cfg.n_layers + 2)  # 7 projections per layer, the embedding and the head, twice
    assert max(seen) == largest
    assert files[-1].name == "onnx_config.json"

"""The streamed ONNX export (export/onnx/onnx_export.py, CLI export/onnx_stream.py): the graph traced over
placeholder weights, the real weights streamed from the checkpoint into external data. It must
equal PyTorch and be served by serving.backends.onnxrt_backend as it is. The model is the suite's `tiny_run`
(trained by training/train.py on the shipped corpus). The time/RSS targets of the `400m` preset are
measured by tests/benchmarks/bench_export.py (fp32) and bench_onnx_export.py (fp32, int8, int4)."""

from __future__ import annotations

import sys

import numpy as np
import preloaded
import pytest
from conftest import REPO

from export.onnx.onnx_export import export_onnx, placeholder_model

PROMPTS = ("আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।", "নদীর ধারে একটি ছোট গ্রাম। The river is quiet.")


@pytest.fixture(scope="module")
def streamed(tiny_run, tmp_path_factory):
    from export.manifest import load_source

    d = tmp_path_factory.mktemp("stream") / "onnx"
    export_onnx(load_source(tiny_run), d)
    return d


def test_placeholder_weights_hold_no_memory():
    from training.model.decoder import preset

    m = placeholder_model(preset("400m"))
    storage = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in m.parameters()}
    assert sum(storage.values()) <= 4 * len(storage)  # one float per parameter, not 1.5 GB
    assert m.output.weight is m.tok_embeddings.weight  # the tied head stays one tensor


def test_streamed_export_equals_pytorch_and_is_served(streamed, tiny_run):
    import json

    import onnx

    from serving.backends.onnxrt_backend import OnnxBackend
    from serving.backends.torch_backend import TorchBackend

    meta = json.loads((streamed / "onnx_config.json").read_text())
    assert meta["external_data"] and meta["checks"]["fp32"]["max_abs_diff_vs_torch"] <= 1e-4
    proto = onnx.load(str(streamed / "model.onnx"), load_external_data=False)
    # the weights live only in model.onnx_data; the graph keeps small folded constants (RoPE frequencies, shapes)
    assert proto.ByteSize() < 1 << 20
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer if len(t.raw_data) > 1024)
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer) >= 9 * 2 + 2
    ref, ours = TorchBackend(tiny_run, threads=1), OnnxBackend(streamed, threads=1)
    for p in PROMPTS:
        ids = ref.tokenize(p)
        assert ours.tokenize(p) == ids
        assert np.abs(ref.logits(ids) - ours.logits(ids)).max() <= 1e-4
        assert np.abs(ref.logits(ids) - ours.logits_incremental(ids, prefix=3)).max() <= 1e-4


def test_streamed_export_refuses_to_overwrite_and_bad_checkpoints(streamed, tiny_run, tmp_path):
    before = (streamed / "model.onnx").read_bytes()
    p = preloaded.run([sys.executable, "-m", "export.onnx_stream", str(tiny_run), "--out", str(streamed)],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: ") and len(p.stderr.strip().splitlines()) == 1
    assert "already exists" in p.stderr and (streamed / "model.onnx").read_bytes() == before
    # a truncated checkpoint: one clear line, nothing written
    import shutil

    from training.checkpoint.checkpoint_io import latest

    bad = tmp_path / "bad"
    shutil.copytree(latest(tiny_run), bad / "checkpoints" / latest(tiny_run).name)
    w = bad / "checkpoints" / latest(tiny_run).name / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    out = tmp_path / "out"
    p = preloaded.run([sys.executable, "-m", "export.onnx_stream", str(bad), "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no temporary folder either

"""Importance-matrix quantization (export/imatrix.py) with llama.cpp's own llama-imatrix and
llama-quantize, on the suite's model trained from the shipped corpus (`tiny_run`).

The KL of every quantized file is measured the way parity measures it — KL(PyTorch fp32 ||
llama.cpp) of the next-token distributions, here over every position of the held-out Bangla text
(training/assets/eval/heldout_bn.txt, never seen in training or calibration). Tests that run the
tools skip with "opt-in:" when `scripts/build_llama_tools.sh` has not built them; the bad-input
tests that need no tool always run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import preloaded
import pytest
from conftest import ASSETS, REPO

from export import ExportError
from export.gguf.llama_tools import missing_tools
from export.imatrix import (
    DEFAULT_CALIBRATION,
    HELDOUT_TEXT,
    check_imatrix,
    compute_imatrix,
    heldout_windows,
    imatrix_entries,
    mean_squares,
    quantize_with_imatrix,
    torch_imatrix,
)
from training.model.logprobs import kl_rows

HELDOUT = HELDOUT_TEXT
TOOLS = ("llama-imatrix", "llama-quantize")
needs_tools = pytest.mark.skipif(bool(missing_tools(TOOLS)), reason=(
    f"opt-in: llama.cpp tools {', '.join(missing_tools(TOOLS))} not built; run `bash scripts/build_llama_tools.sh` "
    "or set PRODIP_LLAMA_TOOLS"))
# What an importance matrix does is fixed: llama.cpp picks each block's scales to minimise the
# rounding error weighted by the imatrix, sum_j v_j (W_ij - Q(W)_ij)^2. That is tested directly on the
# quantized weights (a name mismatch or a matrix llama.cpp ignored leaves it unchanged); measured on
# tiny_run: 0.849 with either imatrix.
MAX_WEIGHTED_ERROR_RATIO = 0.95
# Its effect on the model's output is measured, not assumed. Held-out KL ratio imatrix/plain Q4_K_M
# on tiny_run: 0.78 (184 KB corpus), 0.93 (267 KB), 0.997 in CI and 1.099 here on the current corpus
# (PyTorch importance: 1.109): on this 2-layer model the effect is within +-10% either way, so the
# gate only catches an imatrix that damages the model; the issue's <= 0.7 target is for real
# models (tests/benchmarks/bench_imatrix.py).
MAX_KL_RATIO = float(os.environ.get("PRODIP_IMATRIX_MAX_RATIO", "1.25"))
# PyTorch's importance vs llama-imatrix's on the same chunks of the same text: both fp32.
MAX_IMPORTANCE_REL_DIFF = 1e-3


def heldout_kl(ref, cand, windows: list[list[int]]) -> tuple[float, float]:
    """(mean KL(ref || cand), top-1 agreement) over every position of every window."""
    kls, agree = [], []
    for w in windows:
        a, b = ref.logits(w), cand.logits(w)
        kls.append(kl_rows(a, b))
        agree.append(a.argmax(-1) == b.argmax(-1))
    return float(np.concatenate(kls).mean()), float(np.concatenate(agree).mean())


@pytest.fixture(scope="module")
def quants(tiny_run, tmp_path_factory) -> dict[str, Path]:
    """F32 base, plain Q4_K_M (llama.cpp's quantizer through the binding, as `export gguf` makes it),
    the imatrix from llama-imatrix and the one `export gguf --imatrix` computes from PyTorch, both on
    the shipped calibration text, and Q4_K_M / Q5_K_M / Q6_K / IQ4_XS quantized with them."""
    if missing_tools(TOOLS):
        pytest.skip(needs_tools.kwargs["reason"])
    from export.gguf.gguf_export import quantize_gguf, write_gguf
    from export.manifest import load_source

    d = tmp_path_factory.mktemp("imatrix")
    src = load_source(tiny_run)
    files = {"F32": write_gguf(src, d / "m-F32.gguf", "F32")}
    files["Q4_K_M"] = quantize_gguf(files["F32"], d / "m-Q4_K_M.gguf", "Q4_K_M")
    files["imatrix"] = compute_imatrix(files["F32"], DEFAULT_CALIBRATION, d / "m.imatrix.gguf")
    files["torch-imatrix"] = torch_imatrix(tiny_run, DEFAULT_CALIBRATION, d / "m.torch.imatrix.gguf")
    for t in ("Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"):
        files[f"im-{t}"] = quantize_with_imatrix(files["F32"], d / f"m-im-{t}.gguf", t, files["imatrix"])
    files["torch-im-Q4_K_M"] = quantize_with_imatrix(files["F32"], d / "m-torch-im-Q4_K_M.gguf", "Q4_K_M",
                                                     files["torch-imatrix"])
    return files


@pytest.fixture(scope="module")
def reference(tiny_run):
    from serving.backends.torch_backend import TorchBackend

    ref = TorchBackend(tiny_run, threads=1)
    ids = ref.tokenize(HELDOUT.read_text(encoding="utf-8"))
    return ref, heldout_windows(ids, ref.tokenizer.bos_id, ref.n_ctx)


def _kl_of(path: Path, reference) -> tuple[float, float]:
    from serving.backends.llamacpp_backend import LlamaCppBackend

    ref, windows = reference
    b = LlamaCppBackend(path, threads=1)
    try:
        return heldout_kl(ref, b, windows)
    finally:
        b.close()


@needs_tools
def test_imatrix_covers_every_matmul_weight(quants):
    entries = imatrix_entries(quants["imatrix"])
    assert check_imatrix(quants["imatrix"], quants["F32"]) == entries
    r = gguf.GGUFReader(quants["imatrix"])
    datasets = r.fields["imatrix.datasets"].contents()
    assert [Path(d).name for d in datasets] == [DEFAULT_CALIBRATION.name]  # computed on our calibration text
    # every projection of every block (the tied head reads token_embd, which llama-imatrix skips)
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert {k.split(".")[2] for k in entries if k.startswith("blk.")} == set(kinds)


def _weights(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (type, dequantized weight (rows, width))} of every 2-D tensor of a GGUF file."""
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        if len(t.shape) == 2:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            out[t.name] = (t.tensor_type.name, w.reshape(int(t.shape[1]), int(t.shape[0])))
    return out


@needs_tools
@pytest.mark.parametrize("which", ["imatrix", "torch-imatrix"])
def test_imatrix_lowers_the_weighted_rounding_error(quants, which):
    """sum_j v_j (W - Q(W))^2 over every weight quantized to the same type with and without the
    imatrix: llama.cpp's quantizer minimises exactly this, so the imatrix file must be lower."""
    ref = _weights(quants["F32"])
    plain = _weights(quants["Q4_K_M"])
    weighted = _weights(quants[f"{'im' if which == 'imatrix' else 'torch-im'}-Q4_K_M"])
    v = mean_squares(quants[which])
    err = {"plain": 0.0, "imatrix": 0.0}
    compared = []
    for name, (_, w) in ref.items():
        if name not in v or plain[name][0] != weighted[name][0] or plain[name][0] in ("F32", "F16"):
            continue
        compared.append(f"{name}:{plain[name][0]}")
        for label, q in (("plain", plain[name][1]), ("imatrix", weighted[name][1])):
            err[label] += float((((w - q) ** 2) * v[name][None, :]).sum() / v[name].sum())
    assert len(compared) >= 7, compared  # every projection of a block at least
    ratio = err["imatrix"] / err["plain"]
    print(f"\n{which}: weighted rounding error over {len(compared)} tensors, imatrix/plain = {ratio:.3f}")
    assert ratio <= MAX_WEIGHTED_ERROR_RATIO, f"{which} Q4_K_M weighted error is {ratio:.3f}x plain's"


@needs_tools
def test_pytorch_importance_equals_llama_imatrix(quants):
    """What `export gguf --imatrix` computes from the checkpoint is llama-imatrix's statistic."""
    ours, tool = mean_squares(quants["torch-imatrix"]), mean_squares(quants["imatrix"])
    assert set(ours) == set(tool) and len(tool) >= 7
    rel = max(float(np.abs(ours[n] - tool[n]).max() / np.abs(tool[n]).max()) for n in tool)
    print(f"\nmax relative difference, PyTorch importance vs llama-imatrix, over {len(tool)} weights: {rel:.2e}")
    assert rel <= MAX_IMPORTANCE_REL_DIFF


@needs_tools
def test_imatrix_q4_k_m_is_no_worse_than_plain_q4_k_m(quants, reference):
    plain, plain_top1 = _kl_of(quants["Q4_K_M"], reference)
    ratios = {}
    for which in ("im", "torch-im"):
        kl, top1 = _kl_of(quants[f"{which}-Q4_K_M"], reference)
        ratios[which] = kl / plain
        print(f"\nheld-out Bangla KL vs fp32: plain Q4_K_M {plain:.3e} (top-1 {plain_top1:.1%}), "
              f"{which} Q4_K_M {kl:.3e} (top-1 {top1:.1%}), ratio {ratios[which]:.3f}")
    assert all(r <= MAX_KL_RATIO for r in ratios.values()), ratios


@needs_tools
def test_other_imatrix_types_load_and_rank(quants, reference):
    kl = {t: _kl_of(quants[f"im-{t}"], reference)[0] for t in ("Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS")}
    print("\nheld-out Bangla KL vs fp32 (imatrix): " + ", ".join(f"{t} {v:.3e}" for t, v in kl.items()))
    assert all(np.isfinite(v) and v >= 0 for v in kl.values())
    assert kl["Q6_K"] < kl["Q5_K_M"] < kl["Q4_K_M"]  # more bits, less loss
    r = gguf.GGUFReader(quants["im-IQ4_XS"])
    assert "IQ4_XS" in {t.tensor_type.name for t in r.tensors}


# ------------------------------------------------------------------------------------ bad input
def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", "export.imatrix", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def _one_error_line(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _other_model_gguf(run: Path, out: Path) -> Path:
    """A random model with our tokenizer but another width (d_model 512): its imatrix has the
    same tensor names as the tiny model's, with other widths."""
    import torch

    from export.gguf.gguf_export import write_gguf
    from export.manifest import load_source
    from training.checkpoint import checkpoint_io as checkpoint
    from training.model.decoder import Transformer, preset
    from training.text.tokenizer import Tokenizer

    tok = Tokenizer.load(run / "tokenizer.model")
    cfg = preset("tiny", vocab_size=tok.vocab_size, d_model=512, n_heads=8, n_kv_heads=4, ffn_dim=1024)
    torch.manual_seed(1)
    model = Transformer(cfg)
    ck = checkpoint.save(out / "other", 0, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg,
                         tokenizer=tok)
    return write_gguf(load_source(ck), out / "other-F32.gguf", "F32")


@needs_tools
def test_imatrix_of_another_model_is_refused_and_nothing_overwritten(quants, tiny_run, tmp_path):
    """A real llama-imatrix file of a different model must not quantize ours (llama-quantize alone
    only warns about entries it cannot use)."""
    other_im = compute_imatrix(_other_model_gguf(tiny_run, tmp_path), DEFAULT_CALIBRATION, tmp_path / "o.imatrix.gguf")
    with pytest.raises(ExportError, match="another model"):
        check_imatrix(other_im, quants["F32"])
    dst = tmp_path / "kept-Q4_K_M.gguf"
    dst.write_bytes(b"previous file")
    p = _cli("quantize", str(quants["F32"]), str(dst), "--type", "Q4_K_M", "--imatrix", str(other_im), "--force")
    _one_error_line(p, "another model", "width")
    assert dst.read_bytes() == b"previous file"


@needs_tools
def test_truncated_files_are_refused(quants, tmp_path):
    cut_im = tmp_path / "cut.imatrix.gguf"
    cut_im.write_bytes(quants["imatrix"].read_bytes()[:4000])
    dst = tmp_path / "out.gguf"
    p = _cli("quantize", str(quants["F32"]), str(dst), "--imatrix", str(cut_im))
    _one_error_line(p, "not a readable GGUF")
    assert not dst.exists()
    cut_model = tmp_path / "cut-F32.gguf"
    cut_model.write_bytes(quants["F32"].read_bytes()[:100_000])
    out = tmp_path / "x.imatrix.gguf"
    p = _cli("compute", str(cut_model), "--out", str(out))
    _one_error_line(p, "not a readable GGUF")
    assert not out.exists()


def _tiny_gguf(path: Path, arch: str, tensor: str, shape: tuple[int, int]) -> Path:
    """A one-tensor GGUF written by gguf-py, as another tool would write one."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_tensor(tensor, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_of_another_architecture_is_refused(tmp_path):
    """A GGUF written by another tool for another architecture (here gpt2, by gguf-py)."""
    path = _tiny_gguf(tmp_path / "gpt2.gguf", "gpt2", "token_embd.weight", (4, 8))
    out = tmp_path / "x.imatrix.gguf"
    p = _cli("compute", str(path), "--out", str(out))
    _one_error_line(p, "architecture 'gpt2'")
    assert not out.exists()


def test_missing_tool_is_one_clear_line(tmp_path):
    """No llama-imatrix anywhere (empty PRODIP_LLAMA_TOOLS, a HOME without the cache, a bare PATH)."""
    path = _tiny_gguf(tmp_path / "m.gguf", "llama", "blk.0.attn_q.weight", (8, 8))
    (tmp_path / "empty").mkdir()
    env = {"PRODIP_LLAMA_TOOLS": str(tmp_path / "empty"), "HOME": str(tmp_path), "PATH": os.path.dirname(sys.executable)}
    out = tmp_path / "x.imatrix.gguf"
    p = _cli("compute", str(path), "--out", str(out), env=env)
    _one_error_line(p, "llama-imatrix not found", "build_llama_tools.sh")
    assert not out.exists()


def test_shipped_calibration_text_is_disjoint_from_heldout_and_corpus():
    calib = {ln.strip() for ln in DEFAULT_CALIBRATION.read_text(encoding="utf-8").splitlines() if ln.strip()}
    others = {ln.strip() for f in [HELDOUT, *sorted((ASSETS / "corpus").glob("*.txt"))]
              for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()}
    assert len(calib) >= 20 and not calib & others


def test_export_q4_imatrix_measures_its_file_against_plain(tiny_run, tmp_path):
    """`python -m export gguf RUN --q4 --imatrix` (README's command, on the shipped calibration text):
    the imatrix file and Q4_K_M are written, and the manifest records both held-out KLs the export
    measured (imatrix file and a plain twin, against the F32 base). No llama.cpp tool is needed."""
    import json

    out = tmp_path / "exp"
    p = preloaded.run([sys.executable, "-m", "export", "gguf", str(tiny_run), "--q4", "--imatrix", "--no-parity",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    files = json.loads((out / "manifest.json").read_text())["files"]
    (q4,) = [e for e in files.values() if e["format"] == "gguf" and e["type"] == "Q4_K_M"]
    assert q4["imatrix"].endswith(".imatrix.gguf") and q4["calibration"] == DEFAULT_CALIBRATION.name
    assert 0 < q4["heldout_kl"] < 0.05 and 0 < q4["heldout_kl_plain"] < 0.05
    assert ("made Q4_K_M worse" in p.stderr) == (q4["heldout_kl"] > q4["heldout_kl_plain"])


@needs_tools
def test_versus_plain_catches_a_harmful_importance_matrix(quants, tmp_path):
    """The export's check is not a formality: an importance matrix that weighs one input column of
    every weight a million times above the rest quantizes Q4_K_M worse than no matrix at all, and
    versus_plain says so; the real matrix's file stays within MAX_KL_RATIO of its plain twin."""
    from export.gguf.imatrix_format import read_imatrix, write_imatrix
    from export.imatrix import versus_plain

    skewed = {}
    for name, (sums, counts) in read_imatrix(quants["imatrix"]).items():
        s = np.full_like(sums, 1e-6)
        s[..., 0] = 1e6
        skewed[name] = (s, counts)
    bad_im = write_imatrix(skewed, tmp_path / "skewed.imatrix.gguf", datasets=["skewed"], chunk_count=1, chunk_size=256)
    bad = quantize_with_imatrix(quants["F32"], tmp_path / "m-bad-Q4_K_M.gguf", "Q4_K_M", bad_im)
    kl_bad, kl_plain = versus_plain(quants["F32"], bad, "Q4_K_M", nthread=1)
    kl_good, kl_plain2 = versus_plain(quants["F32"], quants["im-Q4_K_M"], "Q4_K_M", nthread=1)
    print(f"\nheld-out KL vs F32: plain {kl_plain:.3e}, llama-imatrix {kl_good:.3e}, skewed {kl_bad:.3e}")
    assert kl_plain2 == pytest.approx(kl_plain)  # the same plain twin both times
    assert kl_bad > MAX_KL_RATIO * kl_plain > 0  # the harm the export warns about, well past the gate
    assert kl_good <= MAX_KL_RATIO * kl_plain  # the real matrix: within the gate (1.10x on this model)

"""GGUF export: metadata and vocabulary, real Q4_K_M, K-quant fallback detection, the llama.cpp
backend (logits, tokenizer, generation, architecture check), the Modelfile."""

from __future__ import annotations

import gguf
import numpy as np
import preloaded
import pytest
import torch

from export.gguf.gguf_export import inspect_gguf, write_gguf
from export.gguf.modelfile import render as render_modelfile
from export.manifest import Manifest, load_source
from export.parity.native_parity import PROMPTS
from serving.backend import SamplingParams, ServingError
from serving.backends.llamacpp_backend import LlamaCppBackend
from serving.backends.torch_backend import TorchBackend
from training.checkpoint import checkpoint_io as checkpoint
from training.model.decoder import Transformer, preset
from training.text.chat_template import CHAT_TEMPLATE, OLLAMA_TEMPLATE

FP32_TOL = 1e-4
GREEDY_TOKENS = 24
TEXT = "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। Hello 123"


def _field(r: gguf.GGUFReader, key: str):
    return r.fields[key].contents()


def _file(out, t):
    return next((out / "gguf").glob(f"*-{t}.gguf"))


def test_metadata_vocabulary_and_tensor_types(trained_run, exported):  # noqa: F811
    ck = checkpoint.load(trained_run)
    cfg, tok = ck.config, ck.tokenizer
    r = gguf.GGUFReader(_file(exported, "F16"))
    assert _field(r, "general.architecture") == "llama"
    expect = {"llama.context_length": cfg.max_seq_len, "llama.embedding_length": cfg.d_model,
              "llama.block_count": cfg.n_layers, "llama.feed_forward_length": cfg.ffn_dim,
              "llama.attention.head_count": cfg.n_heads, "llama.attention.head_count_kv": cfg.n_kv_heads,
              "llama.rope.dimension_count": cfg.head_dim, "llama.vocab_size": cfg.vocab_size,
              "general.file_type": 1, "tokenizer.ggml.bos_token_id": tok.bos_id,
              "tokenizer.ggml.eos_token_id": tok.eos_id, "tokenizer.ggml.unknown_token_id": tok.unk_id,
              "tokenizer.ggml.padding_token_id": tok.pad_id, "tokenizer.ggml.eot_token_id": tok.im_end_id,
              "tokenizer.ggml.model": "llama", "tokenizer.ggml.add_bos_token": True,
              "tokenizer.ggml.add_eos_token": False, "tokenizer.ggml.add_space_prefix": False,
              "tokenizer.chat_template": CHAT_TEMPLATE}
    for k, v in expect.items():
        assert _field(r, k) == v, k
    assert _field(r, "llama.rope.freq_base") == pytest.approx(cfg.rope_theta)
    assert _field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.norm_eps)
    pieces = list(tok.pieces())
    assert _field(r, "tokenizer.ggml.tokens") == [p.text for p in pieces]
    types = _field(r, "tokenizer.ggml.token_type")
    assert types[tok.bos_id] == gguf.TokenType.CONTROL and types[tok.unk_id] == gguf.TokenType.UNKNOWN
    assert types.count(gguf.TokenType.BYTE) == 256
    assert np.allclose(_field(r, "tokenizer.ggml.scores"), [p.score for p in pieces])
    for t in r.tensors:  # norms stay F32, matrices F16
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else gguf.GGMLQuantizationType.F16)


def test_q4_k_m_is_really_q4_k_m(exported):  # noqa: F811
    path = _file(exported, "Q4_K_M")
    r = gguf.GGUFReader(path)
    assert _field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.ffn_gate.weight"] == "Q4_K"
    assert set(types.values()) <= {"Q4_K", "Q6_K", "F32"}
    info = Manifest.read(exported).files("gguf")[f"gguf/{path.name}"]
    assert info["fallbacks"] == [] and info["tensor_types"]["Q4_K"] >= 2 * 4


def test_k_quant_fallback_is_detected_and_reported(trained_run, tmp_path):  # noqa: F811
    """d_model 128 is not a multiple of 256: llama.cpp silently stores those tensors in another type."""
    from export.gguf.gguf_export import export_gguf

    tok = checkpoint.load(trained_run).tokenizer
    cfg = preset("tiny", vocab_size=tok.vocab_size, d_model=128, n_heads=2, n_kv_heads=1, ffn_dim=512, n_layers=1)
    model = Transformer(cfg)
    checkpoint.save(tmp_path / "run", 1, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg,
                    tokenizer=tok)
    src = load_source(tmp_path / "run")
    out = tmp_path / "out"
    man = Manifest.open(out, src, force=False)
    [path] = export_gguf(src, out, ["q4"], man)
    fb = man.files("gguf")[f"gguf/{path.name}"]["fallbacks"]
    names = {f["tensor"] for f in fb}
    assert "blk.0.attn_q.weight" in names and all(f["width"] % 256 for f in fb)
    assert "blk.0.ffn_down.weight" not in names  # input width 512: a real K-quant
    assert inspect_gguf(path, "Q4_K_M")["fallbacks"] == fb


def test_llamacpp_f32_reproduces_checkpoint_logits_and_tokenizer(trained_run, exported):  # noqa: F811
    model, ck = checkpoint.load_model(trained_run)
    ids = ck.tokenizer.encode(TEXT, bos=True)
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].numpy()
    with LlamaCppBackend(_file(exported, "F32"), kv_f32=True) as b:
        assert b.tokenize(TEXT) == ids
        assert b.tokenize(TEXT, bos=False) == ids[1:]
        assert b.detokenize(ids) == TEXT
        assert b.eos_ids == (ck.tokenizer.eos_id, ck.tokenizer.im_end_id)
        assert b.n_ctx == ck.config.max_seq_len and b.name == "llama.cpp-F32"
        # a prodip file is recognized as one (the foreign path would render the same ChatML and hide a mix-up)
        assert b.prodip and b.describe()["kind"] == "prodip" and b.chat_template == CHAT_TEMPLATE
        got = b.logits(ids)
        assert got.shape == ref.shape and np.abs(got - ref).max() <= FP32_TOL
        assert np.abs(b.logits_incremental(ids, prefix=3) - got).max() <= FP32_TOL
        p = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7)
        a, c = list(b.generate(ids, p)), list(b.generate(ids, p))
        assert a == c and len(a) >= 1


def test_llamacpp_f32_greedy_continuations_equal_pytorch_in_full(trained_run, exported):  # noqa: F811
    """Whole greedy continuations (every token, and where each one stops), not a shared prefix; then
    GREEDY_TOKENS tokens forced on both sides (end-of-turn ids not treated as stops), so the comparison
    never depends on how soon a tiny model happens to emit </s>."""
    model, ck = checkpoint.load_model(trained_run)
    ref = TorchBackend.from_model(model, ck.tokenizer)
    greedy = SamplingParams.greedy(GREEDY_TOKENS)
    with LlamaCppBackend(_file(exported, "F32")) as b:
        for text in (TEXT, *PROMPTS):
            ids = ck.tokenizer.encode(text, bos=True)
            want = list(ref.generate(ids, greedy))  # may be empty: </s> right after a full stop
            assert list(b.generate(ids, greedy)) == want, text
        ref.eos_ids = b.eos_ids = ()  # forced length: a sampled </s> is yielded and decoded on
        for text in (TEXT, *PROMPTS):
            ids = ck.tokenizer.encode(text, bos=True)
            want = list(ref.generate(ids, greedy))
            assert len(want) == GREEDY_TOKENS, text
            assert list(b.generate(ids, greedy)) == want, text


def test_backend_rejects_other_architectures_and_bad_ids(tmp_path, exported):  # noqa: F811
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ServingError, match="architecture 'gpt2'"):
        LlamaCppBackend(path)
    with LlamaCppBackend(_file(exported, "Q8_0")) as b:
        with pytest.raises(ServingError, match="outside the vocabulary"):
            b.logits([1, 10**6])
        with pytest.raises(ServingError, match="exceed the context"):
            b.logits([1] * (b.n_ctx + 1))


def test_write_gguf_refuses_quantized_types(trained_run, tmp_path):  # noqa: F811
    from export import ExportError

    with pytest.raises(ExportError, match="quantize_gguf"):
        write_gguf(load_source(trained_run), tmp_path / "x.gguf", "Q8_0")


def test_modelfile():
    text = render_modelfile("run-Q4_K_M.gguf", 256)
    assert text.splitlines()[0] == "FROM ./run-Q4_K_M.gguf"
    assert f'TEMPLATE """{OLLAMA_TEMPLATE}"""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text and 'PARAMETER stop "<|im_start|>"' in text
    assert "PARAMETER num_ctx 256" in text


def test_untied_head_exports_to_gguf_and_hf(trained_run, tmp_path):  # noqa: F811
    """A model with its own output head: output.weight / lm_head.weight are written and used."""
    from export.gguf.gguf_export import export_gguf
    from export.hf.hf_export import export_hf

    tok = checkpoint.load(trained_run).tokenizer
    cfg = preset("tiny", vocab_size=tok.vocab_size, n_layers=1, tie_embeddings=False)
    torch.manual_seed(1)
    model = Transformer(cfg).eval()
    checkpoint.save(tmp_path / "run", 1, weights=checkpoint.weights_for_save(model.state_dict(), cfg), cfg=cfg,
                    tokenizer=tok)
    src = load_source(tmp_path / "run")
    out = tmp_path / "out"
    man = Manifest.open(out, src, force=False)
    export_hf(src, out, man)
    [path] = export_gguf(src, out, ["F32"], man)
    assert "output.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    ids = tok.encode(TEXT, bos=True)
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].numpy()
    with LlamaCppBackend(path) as b:
        assert np.abs(b.logits(ids) - ref).max() <= FP32_TOL
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        assert np.abs(hf(torch.tensor([ids])).logits[0].numpy() - ref).max() <= FP32_TOL


def test_run_with_failed_gates_is_not_exported(trained_run, tmp_path):  # noqa: F811
    import json
    import shutil
    import sys

    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("export"))
    report = json.loads((run / "gates.json").read_text())
    report["passed"] = False
    report["results"][0]["passed"] = False
    (run / "gates.json").write_text(json.dumps(report))
    p = preloaded.run([sys.executable, "-m", "export", "gguf", str(run), "--f16", "--no-parity"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "nothing is exported" in p.stderr and "Traceback" not in p.stderr
    assert not (run / "export").exists()

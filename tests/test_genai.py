"""ONNX Runtime GenAI opens prodip's ONNX export (export/onnx/genai.py): its tokenizer gives our
SentencePiece ids on every shipped text, and it decodes greedily the same tokens as our ONNX Runtime
backend (serving.backends.onnxrt_backend), fp32 and int4, on Bangla prompts. The model is the suite's `tiny_run`
(trained by training/train.py on the shipped corpus), exported by the real exporter. Needs the
`onnxruntime-genai` package (a dev dependency)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import onnxruntime_genai as og  # a dev dependency: absent, this module fails, never skips
import pytest

from export import ExportError
from export.onnx.genai import (
    GENAI_CONFIG,
    GENAI_DIR,
    genai_generate_speed,
    genai_greedy,
    load_genai,
    write_genai_files,
)

PROMPTS = ("বাংলাদেশের রাজধানী ঢাকা। আমাদের গ্রামে", "আজ সকালে বৃষ্টি হয়েছে, তাই", "নদীর ধারে একটি ছোট")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def onnx_dir(tiny_run, tmp_path_factory) -> Path:
    from export.manifest import load_source
    from export.onnx.onnx_export import export_onnx

    d = tmp_path_factory.mktemp("genai") / "onnx"
    export_onnx(tiny_run, d, int4=True)
    write_genai_files(d, load_source(tiny_run), variants=("fp32", "int4"))
    return d


@pytest.mark.parametrize("variant", ["fp32", "int4"])
def test_genai_greedy_tokens_equal_our_ort_backend(onnx_dir, variant):
    from serving.backend import SamplingParams
    from serving.backends.onnxrt_backend import OnnxBackend

    ours = OnnxBackend(onnx_dir, variant=variant, threads=1)
    model = load_genai(onnx_dir / GENAI_DIR / variant, threads=1)
    total = 0
    for prompt in PROMPTS:
        ids = ours.tokenize(prompt)
        ref = list(ours.generate(ids, SamplingParams.greedy(NEW_TOKENS)))
        got = genai_greedy(model, ids, NEW_TOKENS, tuple(ours.eos_ids))
        assert got == ref, (prompt, got, ref)
        total += len(ref)
    assert total >= len(PROMPTS) * 4  # the comparison covered real continuations


def test_genai_tokenizer_equals_ours_on_shipped_text(onnx_dir):
    """GenAI's own tokenizer (onnxruntime-extensions reading our tokenizer.json) against our
    SentencePiece on every shipped text (whole files, lines, JSONL strings; Bangla, English, the
    orthography file's nukta/ZWJ cases) and the hard cases. GenAI does not run our normalizer, so it
    is handed normalize(text), as docs/onnx.md tells apps to."""
    from test_hf_tokenizer import HARD_CASES, shipped_raw

    from training.text.normalization import normalize
    from training.text.tokenizer import Tokenizer

    sp = Tokenizer.load(onnx_dir / "tokenizer.model")
    tok = og.Tokenizer(load_genai(onnx_dir / GENAI_DIR / "fp32", threads=1))
    texts = shipped_raw() + HARD_CASES
    bad = [t for t in texts if [int(i) for i in tok.encode(normalize(t))] != sp.encode(t, allow_special=True)]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, e.g. {[ascii(t[:40]) for t in bad[:3]]}"
    bangla = [t for t in texts if any("\u0980" <= c <= "\u09ff" for c in t)]
    assert len(bangla) > 1000 and any(len(sp.encode(t)) > 200 for t in bangla)  # real breadth, long texts too
    word = "আমাদের গ্রামের"  # whole words merge (Llama's regex pre-split them at each vowel sign)
    assert [int(i) for i in tok.encode(word)] == sp.encode(word) and len(sp.encode(word)) <= 4


def test_genai_generate_speed_reports_its_clocks_exact_figures(onnx_dir, monkeypatch):
    """The figures are exactly what a scripted clock says, worked out by hand: GenAI really loads and
    generates, and each load, prompt pass and new token advances the clock by a set amount. Load 2 s; per
    run (the warm-up, then 2 repeats) a prompt pass and 8 tokens; reported: the best time to first token
    and the best decode rate of the repeats, never the warm-up's (the fastest here)."""
    import export.onnx.genai as G
    from serving.backends.onnxrt_backend import OnnxBackend

    clock = [0.0]
    prompt_s, token_s = [0.004, 0.4, 0.3], [0.001, 0.05, 0.04]  # warm-up, repeat 1, repeat 2
    runs: list[int] = []
    real_load, real_generator = G.load_genai, og.Generator

    class Timed:  # GenAI's generator, each call advancing the clock by its run's cost
        def __init__(self, model, params):
            self.g, self.run = real_generator(model, params), len(runs)
            runs.append(0)

        def append_tokens(self, ids):
            clock[0] += prompt_s[self.run]
            self.g.append_tokens(ids)

        def generate_next_token(self):
            clock[0] += token_s[self.run]
            runs[self.run] += 1
            self.g.generate_next_token()

        def is_done(self):
            return self.g.is_done()

    def timed_load(*a, **k):
        clock[0] += 2.0
        return real_load(*a, **k)

    monkeypatch.setattr(G, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(G, "load_genai", timed_load)
    monkeypatch.setattr(og, "Generator", Timed)
    ids = OnnxBackend(onnx_dir, threads=1).tokenize(PROMPTS[0])
    s = genai_generate_speed(onnx_dir / GENAI_DIR / "fp32", ids, new_tokens=8, threads=1, repeats=2)
    assert runs == [8, 8, 8] and s.new_tokens == 8  # every run decoded the full length
    assert s.load_s == 2.0
    assert s.ttft_s == pytest.approx(0.3 + 0.04, rel=1e-9)  # repeat 2's prompt pass and first token
    assert s.tokens_per_s == pytest.approx(1 / 0.04, rel=1e-9)  # 7 tokens after the first, 0.04 s each


def test_genai_config_describes_our_graph(onnx_dir):
    import json

    cfg = json.loads((onnx_dir / GENAI_DIR / "fp32" / GENAI_CONFIG).read_text())
    dec = cfg["model"]["decoder"]
    assert dec["filename"] == "model.onnx" and (onnx_dir / GENAI_DIR / "fp32" / "model.onnx").samefile(onnx_dir / "model.onnx")
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert cfg["model"]["type"] == "llama" and cfg["search"]["do_sample"] is False


def test_genai_files_refuse_what_is_not_our_export(onnx_dir, tiny_run, tmp_path):
    from export.manifest import load_source

    src = load_source(tiny_run)
    with pytest.raises(ExportError, match="exists"):
        write_genai_files(onnx_dir, src)  # nothing overwritten without force
    with pytest.raises(ExportError, match="int8"):
        write_genai_files(onnx_dir, src, variants=("int8",))  # a variant the export does not hold
    (tmp_path / "model.onnx").write_bytes(b"not ours")
    with pytest.raises(ExportError):
        write_genai_files(tmp_path, src)  # no onnx_config.json: a file from another tool

"""ONNX Runtime GenAI opens prodip's ONNX export (export/genai.py) and decodes greedily the same
tokens as our ONNX Runtime backend (serving.onnxrt), fp32 and int4, on Bangla prompts. The model is
the suite's `tiny_run` (trained by training/train.py on the shipped corpus), exported by the real
exporter. Needs the `onnxruntime-genai` package (a dev dependency)."""

from __future__ import annotations

from pathlib import Path

import pytest

og = pytest.importorskip("onnxruntime_genai", reason="opt-in: pip install onnxruntime-genai (prodip[dev])")

from export import ExportError  # noqa: E402
from export.genai import GENAI_CONFIG, GENAI_DIR, write_genai_files  # noqa: E402

PROMPTS = ("বাংলাদেশের রাজধানী ঢাকা। আমাদের গ্রামে", "আজ সকালে বৃষ্টি হয়েছে, তাই", "নদীর ধারে একটি ছোট")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def onnx_dir(tiny_run, tmp_path_factory) -> Path:
    from export.manifest import load_source
    from export.onnx import export_onnx

    d = tmp_path_factory.mktemp("genai") / "onnx"
    export_onnx(tiny_run, d, int4=True)
    write_genai_files(d, load_source(tiny_run), variants=("fp32", "int4"))
    return d


def _genai_greedy(model, ids: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out: list[int] = []
    while not gen.is_done() and len(out) < n:
        gen.generate_next_token()
        t = int(gen.get_next_tokens()[0])
        if t in eos:
            break
        out.append(t)
    return out


@pytest.mark.parametrize("variant", ["fp32", "int4"])
def test_genai_greedy_tokens_equal_our_ort_backend(onnx_dir, variant):
    from serving.backend import SamplingParams
    from serving.onnxrt import OnnxBackend

    ours = OnnxBackend(onnx_dir, variant=variant, threads=1)
    model = og.Model(str(onnx_dir / GENAI_DIR / variant))
    total = 0
    for prompt in PROMPTS:
        ids = ours.tokenize(prompt)
        ref = list(ours.generate(ids, SamplingParams.greedy(NEW_TOKENS)))
        got = _genai_greedy(model, ids, NEW_TOKENS, tuple(ours.eos_ids))
        assert got == ref, (prompt, got, ref)
        total += len(ref)
    assert total >= len(PROMPTS) * 4  # the comparison covered real continuations


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

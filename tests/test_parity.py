"""Parity end to end on a tiny model trained on real Bangla: every backend meets its threshold, and a
planted defect per backend class is caught (Q/K permutation skipped, wrong RMSNorm eps, wrong <s>
handling, un-normalized serving input, wrong HF config)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fixtures_export import TATOEBA, exported, trained_run  # noqa: F401  (fixtures)

from export.__main__ import main
from export.gguf import write_gguf
from export.manifest import load_source
from export.parity import (
    DECOMPOSED,
    PRECOMPOSED,
    PROMPTS,
    backend_runner,
    kl_rows,
    parse_thresholds,
    run_parity,
    transformers_runner,
)
from serving.llamacpp import LlamaCppBackend
from training.text import normalize


def test_prompt_set_covers_the_hard_cases():
    text = "".join(PROMPTS)
    assert "\u09dc" in PRECOMPOSED and "\u09bc" in DECOMPOSED and normalize(PRECOMPOSED) == normalize(DECOMPOSED)
    for needle in ("\u200d", "\u200c", "২০২৪", "2024", "🎉", "\n\n", "   ", "office"):
        assert needle in text, needle


def test_kl_and_thresholds():
    x = np.random.default_rng(0).standard_normal((4, 16))
    assert np.allclose(kl_rows(x, x), 0) and (kl_rows(x, x + np.eye(4, 16)) > 0).all()
    th = parse_thresholds(["llama.cpp-Q4_K_M.kl=0.08"])
    assert th["llama.cpp-Q4_K_M"] == {"kl": 0.08, "top1": 0.90} and th["safetensors"] == {"max_abs": 0.0}
    with pytest.raises(ValueError, match="KIND.METRIC=VALUE"):
        parse_thresholds(["q4=1"])


@pytest.mark.slow
def test_export_all_then_parity_meets_every_threshold(trained_run, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "export"
    args = ["all", str(trained_run), "--out", str(out), "--f32", "--f16", "--q8", "--q4", "--int8", "--int4"]
    if TATOEBA.is_file():
        args += ["--texts", str(TATOEBA)]
    rc = main(args)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads((out / "parity.json").read_text())
    kinds = {r["kind"] for r in report["backends"]}
    assert {"safetensors", "transformers", "llama.cpp-F32", "llama.cpp-F16", "llama.cpp-Q8_0",
            "llama.cpp-Q4_K_M", "onnx-fp32", "onnx-int8", "onnx-int4"} <= kinds
    assert report["passed"] and all(r["passed"] for r in report["backends"])
    for r in report["backends"]:
        assert r["tokenizer_equal"] == r["tokenizer_total"] and r["tokenizer_total"] >= len(PROMPTS) + 2
        if TATOEBA.is_file():
            assert r["tokenizer_total"] > 5000
    by_kind = {r["kind"]: r for r in report["backends"]}
    assert by_kind["safetensors"]["max_abs"] == 0.0
    assert by_kind["llama.cpp-F32"]["max_abs"] <= 1e-4 and by_kind["llama.cpp-F32"]["greedy_match"] > 0
    card = (out / "README.md").read_text()
    assert "## Parity" in card and "llama.cpp-Q4_K_M" in card and "Fertility" in card
    assert (out / "gguf" / "Modelfile").read_text().startswith("FROM ./run-Q4_K_M.gguf")
    man = json.loads((out / "manifest.json").read_text())
    assert {"onnx/model.onnx", "hf/model.safetensors"} <= set(man["files"])
    # an impossible threshold makes the command fail (exit 1), with the table still written
    assert main(["parity", str(trained_run), "--out", str(out), "--threshold", "llama.cpp-Q4_K_M.kl=0"]) == 1
    assert "THRESHOLDS BREACHED" in (out / "parity.md").read_text()


def _gguf_runner(path, cls=LlamaCppBackend):
    return backend_runner(cls(path), str(path))


def _check(trained_run, runners):  # noqa: F811
    return run_parity(trained_run, load_source(trained_run), runners=runners, write=False, n_new=4).results


def test_planted_gguf_defects_are_caught(trained_run, tmp_path):  # noqa: F811
    src = load_source(trained_run)
    good = write_gguf(src, tmp_path / "good-F32.gguf", "F32")
    no_perm = write_gguf(src, tmp_path / "noperm-F32.gguf", "F32", permute_qk=False)
    bad_eps = write_gguf(src, tmp_path / "eps-F32.gguf", "F32",
                         metadata_overrides={"llama.attention.layer_norm_rms_epsilon": 1e-2})
    no_bos = write_gguf(src, tmp_path / "nobos-F32.gguf", "F32",
                        metadata_overrides={"tokenizer.ggml.add_bos_token": False})

    class UnnormalizedBackend(LlamaCppBackend):  # a serving path that forgets normalize()
        def tokenize(self, text, *, bos=True, allow_special=False):
            return self.llm.tokenize(text.encode(), add_bos=bos, special=allow_special)

    runners = [_gguf_runner(p) for p in (good, no_perm, bad_eps, no_bos)] + [_gguf_runner(good, UnnormalizedBackend)]
    try:
        ok, perm, eps, bos, unnorm = _check(trained_run, runners)
    finally:
        for r in runners:
            r.close()
    assert ok["passed"], ok["failures"]
    assert not perm["passed"] and perm["max_abs"] > 1.0 and perm["top1"] < 0.9
    assert not eps["passed"] and eps["max_abs"] > 1e-4
    assert not bos["passed"] and any("tokenizer" in f for f in bos["failures"]) and bos["tokenizer_equal"] == 0
    assert not unnorm["passed"] and 0 < unnorm["tokenizer_total"] - unnorm["tokenizer_equal"] < 3
    assert unnorm["max_abs"] <= 1e-4  # same model: only the tokenizer check can see this defect


def test_planted_hf_config_defect_is_caught(trained_run, exported, tmp_path):  # noqa: F811
    hf = tmp_path / "hf"
    shutil.copytree(exported / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-2
    (hf / "config.json").write_text(json.dumps(cfg))
    src = load_source(trained_run)
    good, bad = _check(trained_run, [transformers_runner(src, exported / "hf"), transformers_runner(src, hf)])
    assert good["passed"] and good["max_abs"] <= 1e-4
    assert not bad["passed"] and bad["max_abs"] > 1e-4

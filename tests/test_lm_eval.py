"""lm-evaluation-harness on the HF export: the `lm_eval` command of docs/export.md, run through
lm_eval's own CLI, scores prodip_mc_bn and prodip_mc_en with the same accuracies (acc, acc_norm,
acc_bytes) and per-choice log-likelihoods as training.evaluate on the same checkpoint and items."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from conftest import REPO

from export.lm_eval_tasks import TASK_DIR, TASKS
from training.checkpoint.checkpoint_io import load_model
from training.evaluate.mc import load_mc, score_mc
from training.evaluate.providers import RunnerScorer
from training.model.runner import TransformerRunner
from training.text.normalization import normalize

DOC = REPO / "docs" / "export.md"
EVAL_DIR = REPO / "training" / "assets" / "eval"
HF_PLACEHOLDER = "RUN/export/hf"
LL_TOL = 1e-4  # fp32 log-likelihood, ours vs transformers (measured <= 1e-5)
# lm_eval's metric -> training.evaluate's score kind
METRICS = {"acc": "acc", "acc_norm": "acc_norm_char", "acc_bytes": "acc_norm_byte"}


def documented_command() -> list[str]:
    """The `lm_eval ...` line of docs/export.md (backslash continuations joined), split into words."""
    lines, out, pending = DOC.read_text(encoding="utf-8").splitlines(), [], ""
    for line in lines:
        if pending or line.startswith("lm_eval "):
            pending += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                out.append(shlex.split(pending))
                pending = ""
    assert len(out) == 1, f"expected one lm_eval command in {DOC}, found {len(out)}"
    return out[0]


def test_task_docs_are_training_evaluates_items():
    """The documents lm_eval sees are load_mc's items; its length normalizers count what ours count."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prodip_lm_eval_utils", TASK_DIR / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    for name in TASKS:
        assert (TASK_DIR / f"{name}.yaml").is_file()
        _, items = load_mc(EVAL_DIR / f"{name}.jsonl")
        docs = utils.docs(name)
        assert len(docs) == len(items) > 0
        for d, it in zip(docs, items, strict=True):
            assert [d["context"]] * len(d["choices"]) == it.contexts and d["choices"] == it.continuations
            assert d["gold"] == it.gold and all(c.startswith(" ") for c in d["choices"])
            assert [len(c) for c in d["choices"]] == [len(normalize(c)) for c in it.continuations]


def test_documented_lm_eval_command_matches_training_evaluate(trained_run, exported, tmp_path, monkeypatch):  # noqa: F811
    from lm_eval.__main__ import cli_evaluate  # the `lm_eval` console script

    words = documented_command()
    assert words[0] == "lm_eval" and HF_PLACEHOLDER in " ".join(words)
    out = tmp_path / "lm_eval"
    argv = [w.replace(HF_PLACEHOLDER, str(exported / "hf")) for w in words]
    argv += ["--device", "cpu", "--output_path", str(out), "--log_samples"]
    monkeypatch.chdir(REPO)  # --include_path export/lm_eval_tasks is relative to the repository root
    monkeypatch.setattr(sys, "argv", argv)
    cli_evaluate()

    results = json.loads(next(out.rglob("results_*.json")).read_text(encoding="utf-8"))["results"]
    model, ck = load_model(trained_run)
    provider = RunnerScorer(TransformerRunner(model, ck.tokenizer))
    for name in TASKS:
        _, items = load_mc(EVAL_DIR / f"{name}.jsonl")
        ours = score_mc(provider, items, progress=False)
        summary = ours.summary()
        for theirs, kind in METRICS.items():
            assert results[name][f"{theirs},none"] == pytest.approx(summary[kind]["value"], abs=1e-12), (name, kind)
        samples = [json.loads(x) for x in next(out.rglob(f"samples_{name}_*.jsonl")).read_text().splitlines()]
        assert sorted(s["doc_id"] for s in samples) == list(range(len(items)))
        for s in samples:
            lls = [float(r[0][0]) for r in s["resps"]]
            assert lls == pytest.approx(ours.loglik[s["doc_id"]], abs=LL_TOL), (name, s["doc_id"])

"""export/parity/native_parity.py's arithmetic and verdicts on hand-built inputs, no trained model and no export: the
expected numbers come from the definitions (KL(p || q) = sum p log p/q, top-1 agreement = agreeing
positions / all positions, a threshold met exactly passes), written out by hand for 1-3 token
examples. These are the fast tests the `parity` mutation target runs (test_parity.py trains and exports).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import export.parity.native_parity as P
from serving.backend import SamplingParams
from training.model.decoder import ModelConfig, Transformer
from training.model.gguf_names import to_hf
from training.runfiles.layout import HF_DIR, MODEL_WEIGHTS, PARITY_JSON, PARITY_MD, TOKENIZER
from training.text.normalization import normalize

LN3 = math.log(3.0)


class CharTok:
    """A stand-in for the training tokenizer: <s> (id 1) then one id per character, so lengths are countable."""

    vocab_size, eos_id, im_end_id = 16, 2, 3
    sha256 = "abc"

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, allow_special: bool = False) -> list[int]:
        return [1] * bos + [4 + ord(c) % 12 for c in text] + [9] * allow_special


class Fake:
    """A Backend whose every answer is given: logits per id sequence, greedy continuations per id sequence."""

    def __init__(self, name: str = "fake", logits: Callable[[list[int]], np.ndarray] | None = None,
                 cont: Callable[[list[int]], list[int]] | None = None, tokenize: Callable[..., list[int]] | None = None,
                 incremental: Callable[[list[int], int], np.ndarray] | None = None, n_ctx: int = 64) -> None:
        self.name, self.n_ctx, self.eos_ids = name, n_ctx, (2,)
        self._logits = logits or (lambda ids: np.zeros((len(ids), 3), dtype=np.float32))
        self._cont = cont or (lambda ids: [5, 6])
        self._tok = tokenize or (lambda text, bos, allow_special: CharTok().encode(text, bos=bos,
                                                                                  allow_special=allow_special))
        self._inc = incremental or (lambda ids, prefix: self._logits(ids))
        self.calls: list[tuple] = []
        self.closed = 0

    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]:
        return list(self._tok(text, bos, allow_special))

    def detokenize(self, ids: Sequence[int]) -> str:
        return ""

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self._logits(list(ids))

    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray:
        self.calls.append(("incremental", list(ids), prefix))
        return self._inc(list(ids), prefix)

    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        self.calls.append(("generate", list(ids), params))
        return iter(np.asarray(self._cont(list(ids)), dtype=np.int64))  # numpy ints: greedy must make them int

    def close(self) -> None:
        self.closed += 1


def ref_of(ids: list[list[int]], logits: list[np.ndarray], greedy: list[list[int]] | None = None, n_new: int = 3,
           texts: list[str] | None = None) -> P.Reference:
    return P.Reference(CharTok(), ["p"] * len(ids), ids, logits, greedy or [], n_new, texts or [])


def kl2(p_logits: Sequence[float], q_logits: Sequence[float]) -> float:
    """KL(softmax p || softmax q) written out from the definition."""
    zp, zq = sum(math.exp(v) for v in p_logits), sum(math.exp(v) for v in q_logits)
    p = [math.exp(v) / zp for v in p_logits]
    q = [math.exp(v) / zq for v in q_logits]
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))


def metrics(**over: object) -> dict:
    """A backend's metrics that meet every default threshold of every kind; `over` replaces some."""
    m = {"max_abs": 0.0, "kl": 0.0, "top1": 1.0, "tokenizer_equal": 5, "tokenizer_total": 5, "greedy_equal": 4,
         "greedy_prompts": 4, "incremental": {"max_abs": 0.0, "kl": 0.0}}
    m.update(over)
    return m


# ------------------------------------------------------------------------------------ logit metrics
def test_logit_metrics_on_a_hand_computed_two_prompt_example() -> None:
    # prompt A (3 positions): row 0 p=(1/2,1/2) vs q=(3/4,1/4): KL = 1/2 ln(4/3), both argmax 0;
    # row 1 identical; row 2 argmax 1 vs 0 (disagree), |Δ| up to 2. Prompt B (1 position): identical.
    ra = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    ba = np.array([[LN3, 0.0], [1.0, 0.0], [0.5, 0.0]], dtype=np.float32)
    rb = np.array([[0.0, 1.0]])
    table = {(1, 2, 3): ba, (7,): rb.astype(np.float32)}
    b = Fake(logits=lambda ids: table[tuple(ids)])
    m = P.logit_metrics(ref_of([[1, 2, 3], [7]], [ra, rb]), b)
    kl_a0, kl_a2 = 0.5 * math.log(4 / 3), kl2([0.0, 2.0], [0.5, 0.0])
    assert m["positions"] == 4
    assert m["max_abs"] == 2.0
    assert m["kl"] == pytest.approx((kl_a0 + 0.0 + kl_a2 + 0.0) / 4, rel=1e-6)  # mean over positions, not prompts
    assert m["top1"] == 3 / 4


def test_logit_metrics_refuse_a_reference_with_fewer_logits_than_prompts() -> None:
    # comparing only the prompts that have logits would vouch for prompts never compared
    with pytest.raises(ValueError):
        P.logit_metrics(ref_of([[1], [2]], [np.zeros((1, 2))]), Fake(logits=lambda ids: np.zeros((1, 2), np.float32)))


def test_logit_metrics_max_abs_is_the_largest_over_every_prompt() -> None:
    # the largest difference (3) sits in the first prompt, a smaller one (1) in the last
    r = [np.zeros((1, 2)), np.zeros((1, 2))]
    table = {(1,): np.array([[3.0, 0.0]], dtype=np.float32), (2,): np.array([[0.0, -1.0]], dtype=np.float32)}
    m = P.logit_metrics(ref_of([[1], [2]], r), Fake(logits=lambda ids: table[tuple(ids)]))
    assert m["max_abs"] == 3.0 and m["top1"] == 1.0 and m["positions"] == 2


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN reaches the KL too
def test_logit_metrics_nan_is_infinitely_far_and_a_wrong_shape_is_refused() -> None:
    r = [np.zeros((2, 2))]
    nan = Fake(logits=lambda ids: np.array([[np.nan, 0.0], [0.0, 0.0]], dtype=np.float32))
    assert P.logit_metrics(ref_of([[1, 2]], r), nan)["max_abs"] == math.inf
    # a NaN after a finite difference: still infinitely far (max(1.0, nan) is 1.0 in Python; this was a bug)
    table = {(1,): np.array([[1.0, 0.0]], dtype=np.float32), (2,): np.array([[np.nan, 0.0]], dtype=np.float32)}
    later = Fake(logits=lambda ids: table[tuple(ids)])
    assert P.logit_metrics(ref_of([[1], [2]], [np.zeros((1, 2))] * 2), later)["max_abs"] == math.inf
    inf = Fake(logits=lambda ids: np.array([[np.inf, 0.0], [0.0, 0.0]], dtype=np.float32))
    assert P.logit_metrics(ref_of([[1, 2]], r), inf)["max_abs"] == math.inf
    wide = Fake(name="wide", logits=lambda ids: np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(P.ParityError, match=r"wide: logits of shape \(2, 3\), expected \(2, 2\)"):
        P.logit_metrics(ref_of([[1, 2]], r), wide)


# ------------------------------------------------------------------------------------ greedy
def test_greedy_asks_for_n_greedy_tokens_and_returns_ints() -> None:
    b = Fake(cont=lambda ids: [7, 8])
    got = P.greedy(b, [1, 2], 5)
    assert got == [7, 8] and all(type(t) is int for t in got)
    params = b.calls[0][2]
    assert b.calls[0][1] == [1, 2] and params.max_new_tokens == 5 and params.temperature == 0.0
    assert params.top_k == 0 and params.top_p == 1.0 and params.repetition_penalty == 1.0


def test_greedy_metrics_count_leading_agreement_and_whole_continuations() -> None:
    want = [[4], [5, 6, 7], [5, 6], [5, 6, 7]]
    got = {(1,): [4],  # whole
           (2,): [5, 6, 8],  # 2 leading tokens agree, not whole
           (3,): [5, 6, 9],  # all of want agrees, but longer: not whole
           (4,): [5]}  # stopped early: 1 leading
    b = Fake(cont=lambda ids: got[tuple(ids)])
    ids = [[1], [2], [3], [4], [5]]  # a fifth prompt with no reference continuation is not generated
    m = P.greedy_metrics(ref_of(ids, [np.zeros((1, 2))] * 5, want, n_new=3), b)
    assert m == {"greedy_match": 1 + 2 + 2 + 1, "greedy_total": 1 + 3 + 2 + 3, "greedy_equal": 1, "greedy_prompts": 4}
    assert [c[1] for c in b.calls] == [[1], [2], [3], [4]] and all(c[2].max_new_tokens == 3 for c in b.calls)


# ------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_metrics_count_texts_and_show_at_most_three_mismatches() -> None:
    texts = ["a", "b" * 70, "c", "d", "e"]

    def tok(text: str, bos: bool, allow_special: bool) -> list[int]:
        right = CharTok().encode(text, bos=bos, allow_special=allow_special)
        return right if text in ("a", P.CHAT_PROMPT) else [0] * 20  # wrong on b, c, d, e

    m = P.tokenizer_metrics(ref_of([], [], texts=texts), Fake(tokenize=tok))
    assert m["tokenizer_equal"] == 2 and m["tokenizer_total"] == 6  # five texts plus the chat prompt
    assert len(m["tokenizer_mismatches"]) == 3
    first = m["tokenizer_mismatches"][0]
    assert first["text"] == "b" * 60 and first["got"] == [0] * 12
    assert first["want"] == CharTok().encode("b" * 70, bos=True)[:12]
    assert [x["text"] for x in m["tokenizer_mismatches"][1:]] == ["c", "d"]


def test_tokenizer_metrics_use_bos_and_special_tokens_only_for_the_chat_prompt() -> None:
    seen: list[tuple[str, bool, bool]] = []

    def tok(text: str, bos: bool, allow_special: bool) -> list[int]:
        seen.append((text, bos, allow_special))
        return CharTok().encode(text, bos=bos, allow_special=allow_special)

    m = P.tokenizer_metrics(ref_of([], [], texts=["x"]), Fake(tokenize=tok))
    assert seen == [("x", True, False), (P.CHAT_PROMPT, True, True)]
    assert (m["tokenizer_equal"], m["tokenizer_total"], m["tokenizer_mismatches"]) == (2, 2, [])


# ------------------------------------------------------------------------------------ incremental
def test_incremental_metrics_compare_the_first_prompt_half_cached() -> None:
    full = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [2.0, 2.0], [0.0, 1.0]], dtype=np.float32)
    step = np.array([[LN3, 0.0], [1.0, 0.0], [0.0, 0.0], [2.0, 2.0], [0.0, 1.0]], dtype=np.float32)
    b = Fake(logits=lambda ids: full, incremental=lambda ids, prefix: step)
    m = P.incremental_metrics(ref_of([[1, 2, 3, 4, 5], [6]], [full, full[:1]]), b)
    calls = b.calls
    assert calls == [("incremental", [1, 2, 3, 4, 5], 2)] and type(calls[0][2]) is int  # the first prompt, 5 // 2
    assert m["max_abs"] == pytest.approx(LN3, rel=1e-6)
    assert m["kl"] == pytest.approx(0.5 * math.log(4 / 3) / 5, rel=1e-5)  # mean over the 5 positions


# ------------------------------------------------------------------------------------ verdicts
@pytest.mark.parametrize(("kind", "metric", "at", "past"), [
    ("llama.cpp-Q4_K_M", "kl", 0.05, 0.0501),  # upper bound: equal passes
    ("llama.cpp-Q4_K_M", "top1", 0.90, 0.8999),  # lower bound: equal passes
    ("onnx-fp32", "max_abs", 1e-4, 1.01e-4),
])
def test_a_threshold_met_exactly_passes_and_just_past_fails(kind: str, metric: str, at: float, past: float) -> None:
    limits = P.DEFAULT_THRESHOLDS[kind]
    assert P.failures_of(metrics(**{metric: at}), kind, limits) == []
    op = ">=" if metric == "top1" else "<="
    assert P.failures_of(metrics(**{metric: past}), kind, limits) == [f"{metric} {past:.3g} not {op} {at:g}"]


def test_a_bit_exact_kind_fails_on_any_difference() -> None:
    assert P.failures_of(metrics(max_abs=0.0), "safetensors", {"max_abs": 0.0}) == []
    assert P.failures_of(metrics(max_abs=1e-9), "safetensors", {"max_abs": 0.0}) == ["max_abs 1e-09 not <= 0"]
    assert P.failures_of(metrics(max_abs=math.nan), "safetensors", {"max_abs": 0.0}) == ["max_abs nan not <= 0"]


def test_every_failure_is_listed_at_once() -> None:
    m = metrics(kl=1.0, top1=0.5)
    assert P.failures_of(m, "llama.cpp-Q4_K_M", {"kl": 0.05, "top1": 0.9}) == ["kl 1 not <= 0.05", "top1 0.5 not >= 0.9"]


def test_tokenizer_ids_must_agree_on_every_text_for_every_kind() -> None:
    for kind in ("onnx-int8", "safetensors"):
        assert P.failures_of(metrics(tokenizer_equal=4, tokenizer_total=5), kind, {}) == [
            "tokenizer ids differ on 1 of 5 texts"]


def test_greedy_continuations_must_be_whole_for_fp32_kinds_only() -> None:
    m = metrics(greedy_equal=1, greedy_prompts=4)
    assert P.failures_of(m, "onnx-fp32", {}) == ["greedy continuations differ on 3 of 4 prompts"]
    assert P.failures_of(m, "llama.cpp-Q4_K_M", {}) == []


def test_incremental_max_abs_is_an_fp32_limit_met_exactly() -> None:
    at, past = metrics(incremental={"max_abs": 1e-4, "kl": 0.0}), metrics(incremental={"max_abs": 2e-4, "kl": 0.0})
    assert P.failures_of(at, "transformers", {}) == []
    assert P.failures_of(past, "transformers", {}) == ["incremental decoding max_abs 0.0002 > 0.0001"]
    assert P.failures_of(past, "onnx-int8", {}) == []  # quantized kinds are judged by KL
    nan = metrics(incremental={"max_abs": math.nan, "kl": math.nan})  # a NaN in cached decoding fails (was a bug)
    assert P.failures_of(nan, "transformers", {}) == ["incremental decoding max_abs nan > 0.0001",
                                                      "incremental decoding KL nan > 0.0001"]


def test_incremental_kl_limit_is_a_tenth_of_the_kinds_kl_budget_or_1e_4() -> None:
    def inc(kl: float) -> dict:
        return metrics(incremental={"max_abs": 1.0, "kl": kl})

    # onnx-int4: KL budget 0.05 -> incremental limit 0.005
    assert P.failures_of(inc(0.005), "onnx-int4", {"kl": 0.05}) == []
    assert P.failures_of(inc(0.0051), "onnx-int4", {"kl": 0.05}) == ["incremental decoding KL 0.0051 > 0.005"]
    # a KL budget under 1e-3 (a tenth under 1e-4) and no KL budget at all: the floor 1e-4
    assert P.failures_of(inc(1e-4), "llama.cpp-F16", {"kl": 1e-4}) == []
    assert P.failures_of(inc(2e-4), "llama.cpp-F16", {"kl": 1e-4}) == ["incremental decoding KL 0.0002 > 0.0001"]
    assert P.failures_of(inc(2e-4), "onnx-int8", {}) == ["incremental decoding KL 0.0002 > 0.0001"]


def test_compare_reports_every_metric_with_the_kinds_thresholds() -> None:
    r = [np.array([[0.0, 1.0], [2.0, 0.0]])]
    same = Fake(name="onnx-int8", logits=lambda ids: r[0].astype(np.float32), cont=lambda ids: [5])
    c = P.Candidate(same, "m.onnx")
    c.notes.append("a note")
    out = P.compare(ref_of([[1, 2]], r, [[5]], texts=["x"]), c)
    assert out["passed"] is True and out["failures"] == []
    assert (out["name"], out["kind"], out["file"], out["notes"]) == ("onnx-int8", "onnx-int8", "m.onnx", ["a note"])
    assert out["thresholds"] == {"kl": 1e-2} and out["thresholds"] is not P.DEFAULT_THRESHOLDS["onnx-int8"]
    assert (out["max_abs"], out["kl"], out["top1"], out["positions"]) == (0.0, 0.0, 1.0, 2)
    assert (out["greedy_equal"], out["tokenizer_equal"], out["incremental"]) == (1, 2, {"max_abs": 0.0, "kl": 0.0})
    # a kind with no thresholds: reported, judged only on tokenizer/incremental
    wrong = Fake(name="mystery", logits=lambda ids: -r[0].astype(np.float32), cont=lambda ids: [5])
    out = P.compare(ref_of([[1, 2]], r, [[5]], texts=["x"]), P.Candidate(wrong, "f"))
    assert out["thresholds"] == {} and out["top1"] == 0.0 and out["max_abs"] == 4.0
    assert out["passed"] is True and out["failures"] == []  # a kind without thresholds is reported, not judged
    # custom thresholds replace the defaults
    out = P.compare(ref_of([[1, 2]], r, [[5]], texts=["x"]), P.Candidate(wrong, "f", "onnx-int8"),
                    {"onnx-int8": {"top1": 0.5}})
    assert out["thresholds"] == {"top1": 0.5} and out["failures"] == ["top1 0 not >= 0.5"]


def test_compare_judges_by_the_candidates_kind() -> None:
    r = [np.array([[0.0, 1.0]])]
    b = Fake(name="x", logits=lambda ids: r[0].astype(np.float32), cont=lambda ids: [6])
    fp32 = P.compare(ref_of([[1]], r, [[5]], texts=["x"]), P.Candidate(b, "f", "onnx-fp32"))
    assert fp32["failures"] == ["greedy continuations differ on 1 of 1 prompts"]
    assert P.compare(ref_of([[1]], r, [[5]], texts=["x"]), P.Candidate(b, "f", "onnx-int8"))["passed"]


def test_a_candidate_takes_its_kind_from_the_backend_unless_given() -> None:
    assert P.Candidate(Fake(name="onnx-int4"), "f").kind == "onnx-int4"
    c = P.Candidate(Fake(name="safetensors reload"), "f", "safetensors")
    assert c.kind == "safetensors" and c.notes == []


# ------------------------------------------------------------------------------------ report
def row(name: str, passed: bool, failures: list[str] | None = None, thresholds: dict | None = None) -> dict:
    return {"name": name, "passed": passed, "failures": failures or [], "max_abs": 1.5e-5, "kl": 2e-3, "top1": 0.975,
            "greedy_match": 60, "greedy_total": 64, "greedy_equal": 3, "greedy_prompts": 4, "tokenizer_equal": 12,
            "tokenizer_total": 12, "incremental": {"max_abs": 3e-6, "kl": 0.0},
            "thresholds": {"kl": 5e-3, "top1": 0.97} if thresholds is None else thresholds}


def test_a_report_passes_only_if_something_was_compared_and_everything_passed() -> None:
    assert not P.ParityReport([], 11, 16, 0).passed
    assert P.ParityReport([row("a", True), row("b", True)], 11, 16, 0).passed
    assert not P.ParityReport([row("a", True), row("b", False)], 11, 16, 0).passed
    d = P.ParityReport([row("a", True)], 11, 16, 2).to_dict()
    assert d == {"passed": True, "prompts": 11, "new_tokens": 16, "extra_texts": 2, "backends": [row("a", True)]}


def test_report_table_and_markdown() -> None:
    rep = P.ParityReport([row("llama.cpp-Q8_0", True), row("x", False, ["kl 1 not <= 0.005", "top1 0.1 not >= 0.97"], {})],
                         11, 16, 2)
    lines = rep.table().splitlines()
    assert lines[0] == ("| backend | max abs Δlogit | mean KL | top-1 | greedy match | tokenizer | incremental Δ | "
                        "thresholds | result |")
    assert lines[1] == "|---|---:|---:|---:|---:|---:|---:|---|---|"
    assert lines[2] == ("| llama.cpp-Q8_0 | 1.50e-05 | 2.00e-03 | 97.5% | 60/64 (3/4 whole) | 12/12 | 3.00e-06 | "
                        "kl ≤ 0.005, top1 ≥ 0.97 | pass |")
    assert lines[3].endswith("| report only | FAIL: kl 1 not <= 0.005; top1 0.1 not >= 0.97 |")
    md = rep.markdown()
    assert md.startswith("Reference: the PyTorch fp32 checkpoint. 11 prompts (same token ids for every backend), "
                         "greedy continuations of 16 tokens, tokenizer parity on 14 texts (incl. one chat prompt).\n\n")
    assert rep.table() in md and md.endswith("\n\n**THRESHOLDS BREACHED**\n")
    assert P.ParityReport([row("a", True)], 11, 16, 0).markdown().endswith("\n\n**all thresholds met**\n")
    assert P.ParityReport([], 11, 16, 0).markdown().endswith(
        "\n\n**NO BACKEND COMPARED**: nothing was checked (no exported file in the manifest)\n")


# ------------------------------------------------------------------------------------ thresholds
def test_threshold_kinds_are_the_fixed_ones_and_every_llama_cpp_type() -> None:
    kinds = P.threshold_kinds()
    assert kinds == sorted(set(kinds))
    assert set(P.DEFAULT_THRESHOLDS) <= set(kinds)
    assert {"onnx-fp32", "onnx-int8", "onnx-int4", "llama.cpp-F32", "llama.cpp-Q6_K", "llama.cpp-Q5_K_M"} <= set(kinds)
    assert not any(k.startswith("llama.cpp-LLAMA") or k == "onnx-" for k in kinds)


def test_threshold_kinds_are_exactly_the_documented_ones() -> None:
    # docs/export.md: KIND is safetensors, transformers, onnx-fp32|int8|int4 or llama.cpp-TYPE for any llama.cpp
    # file type, and nothing else: a spare kind in the set (a mutated "safetensors" beside the real one, which
    # the subset checks above let through) is a threshold nothing reads
    from export.gguf.gguf_export import file_types

    want = {"safetensors", "transformers", "onnx-fp32", "onnx-int8", "onnx-int4", *(f"llama.cpp-{t}" for t in file_types())}
    assert set(P.threshold_kinds()) == want and len(P.threshold_kinds()) == len(want)


@pytest.mark.parametrize("bad", ["XXsafetensorsXX.kl=1", "SAFETENSORS.kl=1", "XXtransformersXX.max_abs=1",
                                 "TRANSFORMERS.max_abs=1"])
def test_a_kind_that_is_a_near_spelling_of_a_real_one_is_refused(bad: str) -> None:
    with pytest.raises(P.ParityError, match=r"^--threshold: bad threshold .*unknown threshold kind"):
        P.parse_thresholds([bad])


def test_parse_thresholds_overrides_adds_and_never_touches_the_defaults() -> None:
    th = P.parse_thresholds(["llama.cpp-Q4_K_M.kl=0.08", "llama.cpp-Q6_K.top1=0.95", "onnx-int8.top1=1"])
    assert th["llama.cpp-Q4_K_M"] == {"kl": 0.08, "top1": 0.90}
    assert th["llama.cpp-Q6_K"] == {"top1": 0.95}  # a kind with no default gets one
    assert th["onnx-int8"] == {"kl": 1e-2, "top1": 1.0}
    assert {k: v for k, v in th.items() if k != "llama.cpp-Q6_K"} != P.DEFAULT_THRESHOLDS
    assert P.DEFAULT_THRESHOLDS["llama.cpp-Q4_K_M"] == {"kl": 0.05, "top1": 0.90}
    assert "llama.cpp-Q6_K" not in P.DEFAULT_THRESHOLDS
    assert P.parse_thresholds([]) == P.DEFAULT_THRESHOLDS
    assert P.parse_thresholds([]) is not P.DEFAULT_THRESHOLDS
    assert P.parse_thresholds([])["safetensors"] is not P.DEFAULT_THRESHOLDS["safetensors"]


@pytest.mark.parametrize("bad", ["q4=1", "=1", ".kl=1", "onnx-int8.=1", "onnx-int8.kl=", "onnx-int8.kl"])
def test_a_malformed_threshold_is_refused(bad: str) -> None:
    with pytest.raises(P.ParityError, match=r"^--threshold: bad threshold .*; use KIND\.METRIC=VALUE, e\.g\. "
                                            r"llama\.cpp-Q4_K_M\.kl=0\.08$"):
        P.parse_thresholds([bad])


@pytest.mark.parametrize(("bad", "why"), [
    ("llama.cpp-Q4KM.kl=0.1", "unknown threshold kind 'llama.cpp-Q4KM' (did you mean 'llama.cpp-Q4_K_M'?)"),
    ("onnx-int8.kll=0.1", "unknown threshold metric 'kll' (did you mean 'kl'?)"),
    ("onnx-int8.top1=1.5", ": onnx-int8.top1 = '1.5': "),  # a probability above 1, named by its key
    ("onnx-int8.kl=-1", ": onnx-int8.kl = '-1': "),  # negative
    ("onnx-int8.kl=nan", ": onnx-int8.kl = 'nan': "),
])
def test_an_unknown_or_out_of_range_threshold_is_refused(bad: str, why: str) -> None:
    with pytest.raises(P.ParityError, match=r"^--threshold: bad threshold ") as e:
        P.parse_thresholds([bad])
    assert why in str(e.value) and "KIND.METRIC" not in str(e.value)


# ------------------------------------------------------------------------------------ prompts
def test_long_prompt_fills_the_context_short_by_the_margin() -> None:
    tok, words = CharTok(), P.LONG_FILLER.split(" ")
    # one token per character plus <s>: a budget of n_ctx - 8 tokens holds n_ctx - 9 characters
    assert P.long_prompt(tok, 17) == f"{words[0]} {words[1]} "  # 1 + 8 tokens = budget 9 exactly
    assert P.long_prompt(tok, 16) == f"{words[0]} "  # budget 8: the second word would make 9
    assert P.long_prompt(tok, 2) == f"{words[0]} "  # a tiny context still gets a budget of 8
    fits = len(P.LONG_FILLER) + 1 + 8  # the filler exactly: budget len + 1
    assert P.long_prompt(tok, fits) == P.LONG_FILLER
    assert P.long_prompt(tok, fits + len(P.LONG_FILLER)) == P.LONG_FILLER * 2
    assert P.long_prompt(tok, fits - 1) == P.LONG_FILLER[:P.LONG_FILLER.rindex(" ", 0, -1) + 1]


def test_prompt_set_is_the_fixed_prompts_then_the_long_one() -> None:
    got = P.prompt_set(CharTok(), 17)
    assert got[:-1] == list(P.PROMPTS) and got[-1] == P.long_prompt(CharTok(), 17)


def test_reference_build_runs_every_prompt_and_greedy_on_the_first_few() -> None:
    def logits(ids: list[int]) -> np.ndarray:
        return np.full((len(ids), 3), float(len(ids)), dtype=np.float32)

    b = Fake(logits=logits, cont=lambda ids: [ids[-1]], n_ctx=40)
    ref = P.Reference.build(b, CharTok(), n_new=2, extra_texts=["e1"])
    assert ref.prompts == [*P.PROMPTS, P.long_prompt(CharTok(), 40)]
    assert ref.ids == [CharTok().encode(p, bos=True) for p in ref.prompts]
    assert all((lg == len(i)).all() and lg.shape == (len(i), 3) for lg, i in zip(ref.logits, ref.ids, strict=True))
    assert ref.greedy == [[i[-1]] for i in ref.ids[:P.GREEDY_PROMPTS]] and ref.n_new == 2
    assert all(c[2].max_new_tokens == 2 for c in b.calls)
    assert ref.texts == [*ref.prompts, "e1"] and ref.tok.sha256 == "abc"


# ------------------------------------------------------------------------------------ backends
def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16,
                                   max_seq_len=32, tie_embeddings=False))


def test_reference_backend_is_the_checkpoint_in_torch(tmp_path: Path) -> None:
    model = tiny_model()
    src = SimpleNamespace(model=lambda: model, tokenizer=CharTok(), path=tmp_path)
    b = P.reference_backend(src)
    assert b.name == P.REFERENCE_NAME and b.path == tmp_path and b.n_ctx == 32
    with torch.no_grad():
        want = model(torch.tensor([[1, 5, 7]]))[0].numpy()
    assert np.array_equal(b.logits([1, 5, 7]), want)


def test_safetensors_backend_reloads_the_exported_weights_bit_exactly(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    hf = tmp_path / HF_DIR
    hf.mkdir()
    save_file({to_hf(k): v.contiguous() for k, v in model.state_dict().items()}, str(hf / MODEL_WEIGHTS))
    loaded: list[Path] = []
    monkeypatch.setattr(P.Tokenizer, "load", staticmethod(lambda p: loaded.append(Path(p)) or CharTok()))
    b = P.safetensors_backend(SimpleNamespace(config=model.cfg), hf)
    assert loaded == [hf / TOKENIZER] and b.name == "safetensors reload" and b.path == hf / MODEL_WEIGHTS
    with torch.no_grad():
        want = model(torch.tensor([[1, 5, 7, 2]]))[0].numpy()
    assert np.array_equal(b.logits([1, 5, 7, 2]), want)


def test_discover_lists_every_exported_file_of_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {f"{HF_DIR}/{MODEL_WEIGHTS}": {"format": "hf"}, f"{HF_DIR}/config.json": {"format": "hf"},
             "m-Q8_0.gguf": {"format": "gguf"}, "onnx/model.onnx": {"format": "onnx"},
             "onnx/model.onnx_data": {"format": "onnx"}, "notes.gguf": {"format": "other"}}
    manifest = SimpleNamespace(files=lambda fmt=None: {k: v for k, v in files.items() if fmt in (None, v["format"])})
    loads: list[tuple] = []
    monkeypatch.setattr(P.serving, "load", lambda path, *a: loads.append((Path(path), *a)) or Fake(name=Path(path).name))
    src = SimpleNamespace()
    monkeypatch.setattr(P, "safetensors_backend", lambda s, hf_dir: Fake(name=f"st:{hf_dir}:{s is src}"))
    monkeypatch.setattr(P, "find_spec", lambda name: object() if name == "transformers" else None)
    made = [f() for f in P.discover(src, tmp_path, manifest)]
    assert [(c.kind, c.file) for c in made] == [
        ("safetensors", str(tmp_path / HF_DIR / MODEL_WEIGHTS)),
        (Path(HF_DIR).name, str(tmp_path / HF_DIR)),
        ("m-Q8_0.gguf", str(tmp_path / "m-Q8_0.gguf")),
        ("model.onnx", str(tmp_path / "onnx/model.onnx"))]
    assert made[0].backend.name == f"st:{tmp_path / HF_DIR}:True"
    assert loads == [(tmp_path / HF_DIR, "transformers"), (tmp_path / "m-Q8_0.gguf",), (tmp_path / "onnx/model.onnx",)]
    # without transformers installed (or without the HF weights) those two are not listed
    monkeypatch.setattr(P, "find_spec", lambda name: None)
    assert len(P.discover(SimpleNamespace(), tmp_path, manifest)) == 3
    del files[f"{HF_DIR}/{MODEL_WEIGHTS}"]
    assert len(P.discover(SimpleNamespace(), tmp_path, manifest)) == 2


# ------------------------------------------------------------------------------------ run_parity
def fake_source(monkeypatch: pytest.MonkeyPatch, reference: Fake) -> SimpleNamespace:
    made: list[SimpleNamespace] = []
    monkeypatch.setattr(P, "reference_backend", lambda src: made.append(src) or reference)
    return SimpleNamespace(tokenizer=CharTok(), made=made)


def zero_logits(ids: list[int]) -> np.ndarray:
    return np.zeros((len(ids), 3), dtype=np.float32)


def test_run_parity_with_given_backends_writes_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = Fake(name="ref", logits=zero_logits)
    src = fake_source(monkeypatch, reference)
    good = Fake(name="onnx-int8", logits=zero_logits)
    good.path = Path("g.onnx")
    bad = Fake(name="onnx-fp32", logits=lambda ids: np.ones((len(ids), 3), dtype=np.float32) * np.arange(3))
    said: list[str] = []
    rep = P.run_parity(tmp_path, src, backends=[good, P.Candidate(bad, "b.onnx", notes=["বাংলা"])], n_new=2,
                       extra_texts=["", "x"], progress=said.append)
    assert src.made == [src] and reference.closed == 1 and good.closed == bad.closed == 0  # the caller closes them
    assert said == ["parity: onnx-int8", "parity: onnx-fp32"]
    assert (rep.prompts, rep.n_new, rep.extra_texts) == (len(P.PROMPTS) + 1, 2, 1)  # the empty text is dropped
    assert [r["passed"] for r in rep.results] == [True, False] and not rep.passed
    assert rep.results[0]["file"] == "g.onnx" and rep.results[1]["file"] == "b.onnx"
    assert [c[2].max_new_tokens for c in reference.calls + good.calls if c[0] == "generate"] == [2] * 8
    assert rep.results[1]["failures"][0] == "max_abs 2 not <= 0.0001"
    assert rep.results[0]["tokenizer_total"] == len(P.PROMPTS) + 1 + 1 + 1  # prompts, one extra text, chat
    text = (tmp_path / PARITY_JSON).read_text(encoding="utf-8")
    assert json.loads(text) == json.loads(json.dumps(rep.to_dict())) and text.endswith("}\n")
    assert '\n  "passed": false,' in text and '"বাংলা"' in text  # indented by 2, Bangla kept readable
    assert (tmp_path / PARITY_MD).read_text(encoding="utf-8") == "# Parity\n\n" + rep.markdown()


def test_run_parity_extra_texts_are_normalized_and_thresholds_apply(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    src = fake_source(monkeypatch, Fake(name="ref", logits=zero_logits))
    texts: list[str] = []
    b = Fake(name="onnx-int8", logits=zero_logits,
             tokenize=lambda t, bos, special: texts.append(t) or CharTok().encode(t, bos=bos, allow_special=special))
    rep = P.run_parity(tmp_path, src, backends=[b], extra_texts=["x\u09dc"], write=False,
                       thresholds={"onnx-int8": {"top1": 1.0}})
    assert normalize("x\u09dc") == "x\u09a1\u09bc"  # the training normalization decomposes the nukta letter
    assert "x\u09a1\u09bc" in texts and "x\u09dc" not in texts
    assert rep.results[0]["thresholds"] == {"top1": 1.0} and rep.passed
    assert rep.results[0]["file"] == ""  # a backend with no path serves no file
    assert rep.n_new == P.DEFAULT_NEW_TOKENS == 16
    assert not (tmp_path / PARITY_JSON).exists() and not (tmp_path / PARITY_MD).exists()


def test_run_parity_from_the_manifest_closes_what_it_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = fake_source(monkeypatch, Fake(name="ref", logits=zero_logits))
    opened = [Fake(name="onnx-int8", logits=zero_logits), Fake(name="onnx-int4", logits=zero_logits)]
    manifest = SimpleNamespace(data={"source": {"checkpoint": "CKPT"}, "tokenizer_sha256": "abc"})
    monkeypatch.setattr(P.Manifest, "read", staticmethod(lambda d: manifest if d == tmp_path else None))
    monkeypatch.setattr(P, "load_source", lambda c: src if c == "CKPT" else None)
    monkeypatch.setattr(P, "discover", lambda s, d, m: [lambda b=b: P.Candidate(b, "f") for b in opened]
                        if (s, d, m) == (src, tmp_path, manifest) else [])
    rep = P.run_parity(tmp_path, write=False)
    assert [r["name"] for r in rep.results] == ["onnx-int8", "onnx-int4"] and rep.passed
    assert [b.closed for b in opened] == [1, 1]
    # given backends but no source: the manifest still names the checkpoint
    rep = P.run_parity(tmp_path, backends=[opened[0]], write=False)
    assert [r["name"] for r in rep.results] == ["onnx-int8"] and opened[0].closed == 1
    manifest.data["tokenizer_sha256"] = "changed"
    with pytest.raises(P.ParityError, match="the source checkpoint's tokenizer changed since the export"):
        P.run_parity(tmp_path, write=False)


def test_run_parity_closes_a_discovered_backend_whose_comparison_failed(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    src = fake_source(monkeypatch, Fake(name="ref", logits=zero_logits))
    broken = Fake(name="onnx-int8", logits=lambda ids: np.zeros((len(ids), 5), dtype=np.float32))
    monkeypatch.setattr(P.Manifest, "read", staticmethod(lambda d: "MANIFEST"))
    monkeypatch.setattr(P, "discover", lambda s, d, m: [lambda: P.Candidate(broken, "f")] if m == "MANIFEST" else [])
    with pytest.raises(P.ParityError, match="logits of shape"):
        P.run_parity(tmp_path, src, backends=None, write=False)
    assert broken.closed == 1

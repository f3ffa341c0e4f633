"""The verification core's module constants, pinned to the numbers the docs promise (#46 item 3).

mutmut 3 never mutates a module-level constant, so no mutation score covers DEFAULT_THRESHOLDS,
FP32_MAX_ABS, TOLERANCE, MAX_VAL_OVERLAP, NGRAM, MAX_DEPTH or the fertility limits: a limit moved in the
code alone would pass every oracle test that reads it back. Each is compared here with the value its
doc states to users (parsed from the doc's own table or sentence, never copied from the code), so moving
a limit fails until the doc moves with it.
"""

from __future__ import annotations

import re

from conftest import REPO

import export.parity.native_parity as P
import training.gates.data_gates as D
import training.gates.model_gates as M
import training.text.fertility as F
from training.runfiles import json_records as records

DOCS = REPO / "docs"


def doc(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def number(text: str) -> float:
    return float(text.replace("%", "e-2").replace("≥", "").replace("≤", "").strip())


def test_parity_thresholds_are_the_documented_table() -> None:
    # docs/export.md: "| llama.cpp F16 | KL ≤ 1e-4, top-1 ≥ 99% |" and so on, one row per backend group
    rows = dict(re.findall(r"^\| ([^|]+?) \| ((?:KL|max abs|bit-exact)[^|]*?) \|$", doc("export.md"), re.M))
    kinds = {"safetensors reload": ["safetensors"], "transformers, ONNX fp32, llama.cpp F32 (F32 KV cache)":
             ["transformers", "onnx-fp32", "llama.cpp-F32"], "llama.cpp F16": ["llama.cpp-F16"],
             "llama.cpp Q8_0": ["llama.cpp-Q8_0"], "llama.cpp Q4_K_M, ONNX int4": ["llama.cpp-Q4_K_M", "onnx-int4"],
             "ONNX int8": ["onnx-int8"]}
    documented: dict[str, dict[str, float]] = {}
    assert set(kinds) <= set(rows), sorted(set(kinds) - set(rows))
    for group in kinds:
        text = rows[group]
        limits = {"max_abs": 0.0} if text.startswith("bit-exact") else {}
        for name, value in re.findall(r"(KL|top-1|max abs) [≤≥] ([\d.e%-]+)", text):
            limits[{"KL": "kl", "top-1": "top1", "max abs": "max_abs"}[name]] = number(value)
        for kind in kinds[group]:
            documented[kind] = limits
    assert documented == P.DEFAULT_THRESHOLDS
    assert P.FP32_MAX_ABS == documented["onnx-fp32"]["max_abs"] == 1e-4


def test_the_compiled_vs_eager_fp32_tolerance_is_the_documented_one() -> None:
    # docs/gates.md: "relative L2 error ≤ 1e-3 (fp32), ..."
    m = re.search(r"relative L2 error ≤ ([\d.e-]+) \(fp32\)", doc("gates.md"))
    assert m, "docs/gates.md no longer states the fp32 tolerance"
    assert M.TOLERANCE["fp32"] == (number(m.group(1)), number(m.group(1)))


def test_the_overlap_gate_is_the_documented_one() -> None:
    # docs/gates.md: "... share a 32-token span with the training tokens ... | ≤ 2% of validation windows |"
    m = re.search(r"`data\.train_val_disjoint` \| [^|]*?share a (\d+)-token span[^|]*\| ≤ ([\d.]+)% of validation",
                  doc("gates.md"))
    assert m, "docs/gates.md no longer states the overlap gate's span and limit"
    assert (int(m.group(1)), float(m.group(2)) / 100) == (D.NGRAM, D.MAX_VAL_OVERLAP)


def test_the_fertility_limits_are_the_documented_defaults() -> None:
    # docs/tokenizer.md's option table: | `--fertility-floor` | 2.0 | ..., `--balance-range LO,HI` | 0.8,1.25 |
    text = doc("tokenizer.md")
    floor = re.search(r"^\| `--fertility-floor` \| ([\d.]+) \|", text, re.M)
    ratio = re.search(r"^\| `--fertility-ratio` \| ([\d.]+) \|", text, re.M)
    rng = re.search(r"^\| `--balance-range LO,HI` \| ([\d.]+),([\d.]+) \|", text, re.M)
    assert floor and ratio and rng, "docs/tokenizer.md no longer states the fertility defaults"
    assert (float(floor.group(1)), float(ratio.group(1))) == (F.DEFAULT_FERTILITY_FLOOR, F.DEFAULT_FERTILITY_RATIO)
    assert (float(rng.group(1)), float(rng.group(2))) == F.DEFAULT_BALANCE_RANGE


def test_the_json_depth_bound_is_the_documented_one() -> None:
    # docs/reliability.md: "a JSON value nested deeper than 64 levels is refused"
    m = re.search(r"nested deeper than (\d+) levels is refused", doc("reliability.md"))
    assert m, "docs/reliability.md no longer states the JSON nesting bound"
    assert int(m.group(1)) == records.MAX_DEPTH

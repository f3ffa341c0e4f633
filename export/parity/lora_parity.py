"""Parity of an adapter run's exports: the reference is the PyTorch fp32 base + adapter (training.model.lora), and
the rows are export.parity.native_parity's (the same prompts, KL / top-1 / max |Δlogit|, greedy continuations, tokenizer,
KV-cache decoding), one per pair the export folder holds:

    llama.cpp-TYPE+lora          the base GGUF of TYPE with the LoRA GGUF applied at run time (llama.cpp's --lora)
    llama.cpp-TYPE (merged)      a --merge GGUF, the adapter folded into the weights
    onnx-VARIANT (merged)        the ONNX export (always merged)
    transformers+peft            transformers on hf/ with PEFT applying hf-lora/ (where peft is installed)

Each row is judged by its kind's thresholds (export.parity.native_parity.DEFAULT_THRESHOLDS, --threshold overrides), and the
fp32 kinds and the F16 base + adapter must reproduce every greedy continuation (ADAPTER_GREEDY_KINDS).
Measured on the tests' tiny chat adapter (rank 4, all seven linears; tests/test_lora_export.py): see the
figures there and in docs/chat.md.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from importlib.util import find_spec
from pathlib import Path

import serving
from export.manifest import Manifest
from export.parity.native_parity import DEFAULT_NEW_TOKENS, Candidate, ParityReport, Reference, compare
from serving.backends.llamacpp_backend import LlamaCppBackend, _type_label
from serving.backends.torch_backend import TorchBackend
from training.runfiles import layout

REFERENCE_NAME = "pytorch base+adapter (fp32)"
# Beyond export.parity.native_parity's rule (fp32 kinds reproduce every greedy continuation): an F16 base + an F32 adapter
# must too ("Done when" of the LoRA issue); quantized bases may flip a near-tie and are judged by KL and top-1.
ADAPTER_GREEDY_KINDS = {"llama.cpp-F32", "llama.cpp-F16", "transformers", "onnx-fp32"}


def reference(src, n_new: int = DEFAULT_NEW_TOKENS) -> Reference:
    """The PyTorch fp32 base + adapter's logits and greedy continuations (computed once per export)."""
    backend = TorchBackend.from_model(src.model(), src.tokenizer, name=REFERENCE_NAME, path=src.path)
    try:
        return Reference.build(backend, src.tokenizer, n_new=n_new, extra_texts=[])
    finally:
        backend.close()


def llama(path: Path, adapter: Path | None, kind_suffix: str) -> Candidate:
    b = LlamaCppBackend(path, lora=adapter)
    b.name = f"llama.cpp-{_type_label(path)}{kind_suffix}"
    return Candidate(b, str(path), f"llama.cpp-{_type_label(path)}")


def onnx(path: Path) -> Candidate:
    b = serving.load(path)
    kind = b.name
    b.name = f"{kind} (merged)"
    return Candidate(b, str(path), kind)


def peft(out: Path) -> Candidate:
    from export.hf.hf_peft import LORA_HF_DIR, peft_backend

    return Candidate(peft_backend(out / layout.HF_DIR, out / LORA_HF_DIR), str(out / LORA_HF_DIR), "transformers")


def candidates(out: Path, manifest: Manifest) -> list[Callable[[], Candidate]]:
    """One factory per pair the folder's manifest lists (opened one at a time, closed after use)."""
    files = manifest.files()
    adapters = [out / rel for rel, e in files.items() if e["format"] == "gguf-lora"]
    made: list[Callable[[], Candidate]] = []
    for rel, e in sorted(files.items()):
        path = out / rel
        if e["format"] == "gguf" and e.get("merged"):
            made.append(lambda path=path: llama(path, None, " (merged)"))
        elif e["format"] == "gguf" and adapters:
            made.append(lambda path=path: llama(path, adapters[0], "+lora"))
        elif e["format"] == "onnx" and rel.endswith(".onnx"):
            made.append(lambda path=path: onnx(path))
    if any(e["format"] == "hf-lora" for e in files.values()) and find_spec("peft") is not None:
        made.append(lambda: peft(out))
    return made


def judge_greedy(row: dict) -> dict:
    if row["kind"] in ADAPTER_GREEDY_KINDS and row["greedy_equal"] != row["greedy_prompts"]:
        why = f"greedy continuations differ on {row['greedy_prompts'] - row['greedy_equal']} of {row['greedy_prompts']} prompts"
        if why not in row["failures"]:
            row["failures"].append(why)
    row["passed"] = not row["failures"]
    return row


def run_adapter_parity(src, out: Path, manifest: Manifest, *, thresholds: Mapping[str, Mapping[str, float]],
                       n_new: int | None = None) -> ParityReport:
    """Every pair in `out` against the PyTorch base + adapter; parity.json and parity.md written into `out`."""
    ref = reference(src, n_new or DEFAULT_NEW_TOKENS)
    results = []
    for make in candidates(out, manifest):
        c = make()
        try:
            print(f"parity: {c.backend.name}", file=sys.stderr)
            results.append(judge_greedy(compare(ref, c, thresholds)))
        finally:
            c.backend.close()
    report = ParityReport(results, len(ref.prompts), ref.n_new, 0)
    (out / layout.PARITY_JSON).write_text(json.dumps({**report.to_dict(), "reference": REFERENCE_NAME}, indent=2,
                                                     ensure_ascii=False) + "\n", encoding="utf-8")
    body = report.markdown().replace("Reference: the PyTorch fp32 checkpoint.",
                                     f"Reference: the PyTorch fp32 base + LoRA adapter ({src.path}, on {src.base.path}).")
    (out / layout.PARITY_MD).write_text("# Parity\n\n" + body, encoding="utf-8")
    return report

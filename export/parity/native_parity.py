"""Cross-backend parity: every exported file against the PyTorch fp32 checkpoint it came from.

Every runner is a `serving.Backend`. The reference is `TorchBackend.from_model` on the checkpoint; the
backends under test are whatever the manifest lists: the safetensors reload (`TorchBackend.from_model`
on the HF weights, names mapped back), transformers, ONNX (fp32/int8/int4) and llama.cpp
(F32/F16/Q8_0/Q4_K_M/...), each opened by `serving.load`. For each, over a fixed prompt set (Bangla
prose and news, both Unicode spellings of ড় ঢ় য়, ZWJ/ZWNJ, Bangla and ASCII digits, English,
code-mixed text, emoji, whitespace runs, one prompt near the context length):

- max |logit difference|, mean KL(reference || backend) over all positions, top-1 agreement,
  all on the same token ids (the training tokenizer's);
- greedy continuations of `n_new` new tokens: identical leading tokens, and whole continuations
  identical (fp32 kinds must reproduce every one exactly);
- tokenizer parity: the backend's own tokenizer gives the training tokenizer's ids on every prompt
  (plus a chat prompt with special tokens, plus any extra texts);
- full-sequence vs incremental (KV-cache) decoding inside the backend.

Thresholds (DEFAULT_THRESHOLDS, overridable per `kind.metric`) are judged on a trained model:
random weights give flat distributions where top-1 agreement means nothing. A report that compared no
backend has not passed: there is nothing it vouches for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import numpy as np

import serving
from export import ExportError
from export.manifest import Manifest, Source, load_source
from serving.backend import Backend, SamplingParams
from serving.backends.torch_backend import TorchBackend
from training.checkpoint import checkpoint_io as checkpoint
from training.model.decoder import Transformer
from training.model.gguf_names import from_hf
from training.model.logprobs import kl_rows
from training.runfiles.layout import HF_DIR, MODEL_WEIGHTS, PARITY_JSON, PARITY_MD, TOKENIZER
from training.runfiles.schema import NonNegFloat, Probability, SchemaError, one_of, parse
from training.text.chat_template import render
from training.text.normalization import normalize
from training.text.tokenizer import BOS, Tokenizer

DEFAULT_NEW_TOKENS = 16
GREEDY_PROMPTS = 4  # greedy continuations from the first few prompts (each costs n_new decode steps)
CONTEXT_MARGIN = 8  # the long prompt stops this many tokens short of the context length
FP32_MAX_ABS = 1e-4
REFERENCE_NAME = "pytorch (reference)"
# Full-sequence vs KV-cache decoding inside one backend: fp32 kinds within FP32_MAX_ABS; others within
# KL INCREMENTAL_KL, or a tenth of the kind's own KL budget when larger (dynamic int8 quantization scales
# activations per call, so one token at a time legitimately differs from a whole sequence).
INCREMENTAL_KL = 1e-4
INCREMENTAL_KL_SHARE = 0.1

# kind -> metric -> limit. max_abs/kl are upper bounds, top1 a lower bound.
DEFAULT_THRESHOLDS: dict[str, dict[str, float]] = {
    "safetensors": {"max_abs": 0.0},  # bit-exact reload
    "transformers": {"max_abs": FP32_MAX_ABS},
    "onnx-fp32": {"max_abs": FP32_MAX_ABS},
    "llama.cpp-F32": {"max_abs": FP32_MAX_ABS},  # with an F32 KV cache
    "llama.cpp-F16": {"kl": 1e-4, "top1": 0.99},
    "llama.cpp-Q8_0": {"kl": 5e-3, "top1": 0.97},
    "llama.cpp-Q4_K_M": {"kl": 0.05, "top1": 0.90},
    "onnx-int8": {"kl": 1e-2},
    "onnx-int4": {"kl": 0.05, "top1": 0.90},
}
FP32_KINDS = {"safetensors", "transformers", "onnx-fp32", "llama.cpp-F32"}
LOWER_BOUNDS = {"top1"}
METRICS = {"max_abs": NonNegFloat, "kl": NonNegFloat, "top1": Probability}  # a threshold metric -> its values

# The prompt set. Precomposed and decomposed nukta letters are spelled with escapes on purpose.
PRECOMPOSED = "প\u09dcা আষা\u09dd সম\u09df বড\u09bc"  # U+09DC/09DD/09DF (+ one already decomposed)
DECOMPOSED = "প\u09a1\u09bcা আষা\u09a2\u09bc সম\u09af\u09bc বড\u09bc"
PROMPTS: tuple[str, ...] = (
    "আমাদের ছোট নদী চলে বাঁকে বাঁকে, বৈশাখ মাসে তার হাঁটু জল থাকে।",
    "ঢাকা, ১২ মার্চ — দেশের উত্তরাঞ্চলে আজ সকাল থেকে ভারী বৃষ্টিপাত হচ্ছে বলে আবহাওয়া অধিদপ্তর জানিয়েছে।",
    f"নুক্তা (যুক্ত রূপ): {PRECOMPOSED}",
    f"নুক্তা (বিযুক্ত রূপ): {DECOMPOSED}",
    "র\u200d্যাব আর ক\u200c্ষ, জ্ঞান ও ক্ষমা: যুক্তাক্ষরের ZWJ/ZWNJ।",
    "২০২৪ সালে ১২৩৪৫ জন, ফোন ০১৭১১-৬৭৮৯০; in 2024 there were 12345 people.",
    "The quick brown fox jumps over the lazy dog, and the rain in Spain stays mainly in the plain.",
    "আমি আজকে office-এ meeting শেষ করে বাসায় ফিরব, OK? Traffic খুব বেশি ছিল।",
    "শুভ জন্মদিন 🎉🎂 ভালো থেকো ❤️ 👍🏽",
    "লাইন এক\n\nলাইন   দুই\t\tশেষ  \n   \n",
)
# rendered by the one template, without its leading "<s>" (the tokenizers add BOS themselves here)
CHAT_PROMPT = render([{"role": "user", "content": "তোমার নাম কী?"}]).removeprefix(BOS)
LONG_FILLER = ("সে অনেক দিনের কথা। গ্রামের প্রান্তে একটি ছোট কুটিরে এক বৃদ্ধ মাঝি থাকত, "
               "প্রতিদিন ভোরে সে নৌকা নিয়ে নদীতে যেত আর সন্ধ্যায় ফিরে এসে গল্প শোনাত। ")


class ParityError(ExportError):
    pass


def long_prompt(tok: Tokenizer, n_ctx: int) -> str:
    """Bangla text whose tokenization (with <s>) ends just short of the context length."""
    budget = max(8, n_ctx - CONTEXT_MARGIN)
    text = ""
    while len(tok.encode(text + LONG_FILLER, bos=True)) <= budget:
        text += LONG_FILLER
    for word in LONG_FILLER.split(" "):
        cand = text + word + " "
        if len(tok.encode(cand, bos=True)) > budget:
            break
        text = cand
    return text


def prompt_set(tok: Tokenizer, n_ctx: int) -> list[str]:
    return [*PROMPTS, long_prompt(tok, n_ctx)]


# ------------------------------------------------------------------------------------------ backends
@dataclass
class Candidate:
    """One backend under test: the Backend, the file it serves, and its threshold kind (its name unless
    several names share one kind's thresholds, as the safetensors reload does)."""

    backend: Backend
    file: str
    kind: str = ""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kind = self.kind or self.backend.name


def greedy(backend: Backend, ids: list[int], n: int) -> list[int]:
    return [int(t) for t in backend.generate(ids, SamplingParams.greedy(n))]


def reference_backend(src: Source) -> TorchBackend:
    return TorchBackend.from_model(src.model(), src.tokenizer, name=REFERENCE_NAME, path=src.path)


def safetensors_backend(src: Source, hf_dir: Path) -> TorchBackend:
    """Our own model on the exported HF weights (names mapped back): must be bit-exact."""
    from safetensors.torch import load_file

    weights = {from_hf(k): v for k, v in load_file(str(hf_dir / MODEL_WEIGHTS)).items()}
    model = Transformer(src.config)
    checkpoint.load_weights(model, weights)
    return TorchBackend.from_model(model, Tokenizer.load(hf_dir / TOKENIZER), name="safetensors reload",
                                   path=hf_dir / MODEL_WEIGHTS)


def discover(src: Source, out_dir: Path, manifest: Manifest) -> list[Callable[[], Candidate]]:
    """Factories for every exported file the manifest lists (loaded one at a time, closed after use)."""
    factories: list[Callable[[], Candidate]] = []
    hf_dir, hf_weights = out_dir / HF_DIR, f"{HF_DIR}/{MODEL_WEIGHTS}"
    if hf_weights in manifest.files("hf"):
        factories.append(lambda: Candidate(safetensors_backend(src, hf_dir), str(hf_dir / MODEL_WEIGHTS),
                                           "safetensors"))
        if find_spec("transformers") is not None:  # a dev/test dependency: compared where installed
            factories.append(lambda: Candidate(serving.load(hf_dir, "transformers"), str(hf_dir)))
    for rel, entry in sorted(manifest.files().items()):
        if entry["format"] in ("onnx", "gguf") and rel.endswith((".onnx", ".gguf")):
            path = out_dir / rel
            factories.append(lambda path=path: Candidate(serving.load(path), str(path)))
    return factories


# --------------------------------------------------------------------------------------- comparison
@dataclass
class Reference:
    tok: Tokenizer
    prompts: list[str]
    ids: list[list[int]]
    logits: list[np.ndarray]
    greedy: list[list[int]]
    n_new: int
    texts: list[str]  # tokenizer parity texts (prompts + extra)

    @classmethod
    def build(cls, backend: Backend, tok: Tokenizer, *, n_new: int, extra_texts: Iterable[str]) -> Reference:
        prompts = prompt_set(tok, backend.n_ctx)
        ids = [tok.encode(p, bos=True) for p in prompts]
        logits = [backend.logits(i) for i in ids]
        conts = [greedy(backend, i, n_new) for i in ids[:GREEDY_PROMPTS]]
        return cls(tok, prompts, ids, logits, conts, n_new, [*prompts, *extra_texts])


def logit_metrics(ref: Reference, b: Backend) -> dict:
    """max |Δlogit|, mean KL(reference || backend) and top-1 agreement over every prompt position."""
    max_abs, kls, agree, n_pos = 0.0, [], 0, 0
    for ids, rl in zip(ref.ids, ref.logits, strict=True):
        bl = np.asarray(b.logits(ids), dtype=np.float32)
        if bl.shape != rl.shape:
            raise ParityError(f"{b.name}: logits of shape {bl.shape}, expected {rl.shape}")
        diff = float(np.abs(bl.astype(np.float64) - rl).max())
        max_abs = max(max_abs, math.inf if math.isnan(diff) else diff)  # max(x, nan) is x: a NaN would vanish
        kls.append(kl_rows(rl, bl))
        agree += int((bl.argmax(-1) == rl.argmax(-1)).sum())
        n_pos += len(ids)
    return {"max_abs": max_abs, "kl": float(np.concatenate(kls).mean()), "top1": agree / n_pos, "positions": n_pos}


def greedy_metrics(ref: Reference, b: Backend) -> dict:
    """Identical leading tokens / reference tokens (a continuation may stop early at </s>), and the
    number of prompts whose whole continuation (tokens and length) is the reference's."""
    match, total, equal = 0, 0, 0
    for ids, want in zip(ref.ids, ref.greedy, strict=False):
        got = greedy(b, ids, ref.n_new)
        same = next((i for i, (x, y) in enumerate(zip(want, got, strict=False)) if x != y), min(len(want), len(got)))
        match += same
        total += len(want)
        equal += int(got == want)
    return {"greedy_match": match, "greedy_total": total, "greedy_equal": equal, "greedy_prompts": len(ref.greedy)}


def tokenizer_metrics(ref: Reference, b: Backend) -> dict:
    """Texts on which the backend's own tokenizer gives the training tokenizer's ids."""
    equal, total, mismatches = 0, 0, []
    for text, special in [(t, False) for t in ref.texts] + [(CHAT_PROMPT, True)]:
        want = ref.tok.encode(text, bos=True, allow_special=special)
        got = list(b.tokenize(text, bos=True, allow_special=special))
        total += 1
        if got == want:
            equal += 1
        elif len(mismatches) < 3:
            mismatches.append({"text": text[:60], "want": want[:12], "got": got[:12]})
    return {"tokenizer_equal": equal, "tokenizer_total": total, "tokenizer_mismatches": mismatches}


def incremental_metrics(ref: Reference, b: Backend) -> dict:
    """The backend's full-sequence logits against its own KV-cache decoding (half in one pass, then one by one)."""
    ids = ref.ids[0]
    full = b.logits(ids)
    step = b.logits_incremental(ids, prefix=len(ids) // 2)
    return {"max_abs": float(np.abs(full.astype(np.float64) - step).max()), "kl": float(kl_rows(full, step).mean())}


def failures_of(m: dict, kind: str, limits: Mapping[str, float]) -> list[str]:
    out = []
    for metric, limit in limits.items():
        v = m[metric]
        if not (v >= limit if metric in LOWER_BOUNDS else v <= limit):
            out.append(f"{metric} {v:.3g} not {'>=' if metric in LOWER_BOUNDS else '<='} {limit:g}")
    if m["tokenizer_equal"] != m["tokenizer_total"]:
        out.append(f"tokenizer ids differ on {m['tokenizer_total'] - m['tokenizer_equal']} of {m['tokenizer_total']} texts")
    if kind in FP32_KINDS and m["greedy_equal"] != m["greedy_prompts"]:
        out.append(f"greedy continuations differ on {m['greedy_prompts'] - m['greedy_equal']} of "
                   f"{m['greedy_prompts']} prompts")
    inc = m["incremental"]
    # `not <=`: a NaN (from a NaN logit) fails, where `>` would let it through
    if kind in FP32_KINDS and not inc["max_abs"] <= FP32_MAX_ABS:
        out.append(f"incremental decoding max_abs {inc['max_abs']:.3g} > {FP32_MAX_ABS:g}")
    inc_kl = max(INCREMENTAL_KL, INCREMENTAL_KL_SHARE * limits.get("kl", 0.0))
    if not inc["kl"] <= inc_kl:
        out.append(f"incremental decoding KL {inc['kl']:.3g} > {inc_kl:g}")
    return out


def compare(ref: Reference, c: Candidate, thresholds: Mapping[str, Mapping[str, float]] = DEFAULT_THRESHOLDS) -> dict:
    """All metrics of one backend against the reference, with verdicts."""
    b = c.backend
    m = {**logit_metrics(ref, b), **greedy_metrics(ref, b), **tokenizer_metrics(ref, b),
         "incremental": incremental_metrics(ref, b)}
    limits = dict(thresholds.get(c.kind, {}))
    failures = failures_of(m, c.kind, limits)
    return {"name": b.name, "kind": c.kind, "file": c.file, **m, "thresholds": limits, "notes": c.notes,
            "passed": not failures, "failures": failures}


# -------------------------------------------------------------------------------------- orchestration
@dataclass
class ParityReport:
    results: list[dict]
    prompts: int
    n_new: int
    extra_texts: int

    @property
    def passed(self) -> bool:
        """Every compared backend met its thresholds, and at least one was compared."""
        return bool(self.results) and all(r["passed"] for r in self.results)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "prompts": self.prompts, "new_tokens": self.n_new,
                "extra_texts": self.extra_texts, "backends": self.results}

    def table(self) -> str:
        rows = ["| backend | max abs Δlogit | mean KL | top-1 | greedy match | tokenizer | incremental Δ | thresholds | result |",
                "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for r in self.results:
            # rows fed token ids (export.parity.arm_parity) have no tokenizer or incremental comparison
            tok = f"{r['tokenizer_equal']}/{r['tokenizer_total']}" if "tokenizer_total" in r else "ids in"
            inc = f"{r['incremental']['max_abs']:.2e}" if "incremental" in r else "-"
            th = ", ".join(f"{k} {'≥' if k in LOWER_BOUNDS else '≤'} {v:g}" for k, v in r["thresholds"].items()) or "report only"
            verdict = "pass" if r["passed"] else "FAIL: " + "; ".join(r["failures"])
            mx, kl, top1 = ("-" if r.get(k) is None else format(r[k], f)  # browser rows: what the runtime exposes
                            for k, f in (("max_abs", ".2e"), ("kl", ".2e"), ("top1", ".1%")))
            rows.append(f"| {r['name']} | {mx} | {kl} | {top1} | "
                        f"{r['greedy_match']}/{r['greedy_total']} ({r['greedy_equal']}/{r['greedy_prompts']} whole) | "
                        f"{tok} | {inc} | {th} | {verdict} |")
        return "\n".join(rows)

    def markdown(self) -> str:
        head = (f"Reference: the PyTorch fp32 checkpoint. {self.prompts} prompts (same token ids for every "
                f"backend), greedy continuations of {self.n_new} tokens, tokenizer parity on "
                f"{self.prompts + self.extra_texts + 1} texts (incl. one chat prompt).")
        verdict = ("**all thresholds met**" if self.passed else "**THRESHOLDS BREACHED**" if self.results
                   else "**NO BACKEND COMPARED**: nothing was checked (no exported file in the manifest)")
        summaries = "".join(f"- {r['summary']}\n" for r in self.results if "summary" in r)  # rows' own notes
        return f"{head}\n\n{self.table()}\n\n" + (summaries + "\n" if summaries else "") + f"{verdict}\n"


def threshold_kinds() -> list[str]:
    """Every kind a threshold may name: the fixed ones and llama.cpp-<TYPE> for each llama.cpp file type."""
    from export.gguf.gguf_export import file_types
    from serving.backends.onnxrt_backend import VARIANT_FILES

    return sorted({*DEFAULT_THRESHOLDS, "safetensors", "transformers", *(f"onnx-{v}" for v in VARIANT_FILES),
                   *(f"llama.cpp-{t}" for t in file_types())})


def parse_thresholds(items: Iterable[str]) -> dict[str, dict[str, float]]:
    """DEFAULT_THRESHOLDS with `kind.metric=value` overrides (e.g. llama.cpp-Q4_K_M.kl=0.08); an unknown
    kind or metric is refused with the nearest name, never silently kept as a threshold nothing reads."""
    out = {k: dict(v) for k, v in DEFAULT_THRESHOLDS.items()}
    kinds: list[str] | None = None
    for item in items:
        key, eq, value = item.partition("=")
        kind, _, metric = key.rpartition(".")
        if not eq or not kind or not metric or not value:
            raise ParityError(f"--threshold: bad threshold {item!r}; use KIND.METRIC=VALUE, e.g. "
                              "llama.cpp-Q4_K_M.kl=0.08")
        kinds = kinds or threshold_kinds()
        try:
            one_of("threshold kind", kind, kinds)
            one_of("threshold metric", metric, METRICS)
            limit = parse(METRICS[metric], value, key)
        except SchemaError as e:
            raise ParityError(f"--threshold: bad threshold {item!r}: {e}") from None
        out.setdefault(kind, {})[metric] = limit
    return out


def run_parity(out_dir: Path, src: Source | None = None, *, thresholds: Mapping[str, Mapping[str, float]] | None = None,
               n_new: int = DEFAULT_NEW_TOKENS, extra_texts: Sequence[str] = (), write: bool = True,
               backends: Sequence[Backend | Candidate] | None = None,
               progress: Callable[[str], None] | None = None,
               extra_rows: Callable[[Source, Path, Reference, Mapping], list[dict]] | None = None) -> ParityReport:
    """Compare every export listed in out_dir/manifest.json (or the given `backends`, which the caller
    closes) with the checkpoint. Writes parity.json and parity.md into out_dir when `write`."""
    manifest = Manifest.read(out_dir) if backends is None or src is None else None
    if src is None:
        src = load_source(manifest.data["source"]["checkpoint"])
        if src.tokenizer.sha256 != manifest.data["tokenizer_sha256"]:
            raise ParityError(f"{out_dir}: the source checkpoint's tokenizer changed since the export")
    reference = reference_backend(src)
    ref = Reference.build(reference, src.tokenizer, n_new=n_new, extra_texts=[normalize(t) for t in extra_texts if t])
    reference.close()
    results = []
    given = [b if isinstance(b, Candidate) else Candidate(b, str(getattr(b, "path", ""))) for b in backends or ()]
    for item in given if backends is not None else discover(src, out_dir, manifest):
        c = item if isinstance(item, Candidate) else item()
        try:
            if progress:
                progress(f"parity: {c.backend.name}")
            results.append(compare(ref, c, thresholds or DEFAULT_THRESHOLDS))
        finally:
            if backends is None:
                c.backend.close()
    if extra_rows is not None:  # rows computed outside this module (export.parity.arm_parity's), same prompts
        results += extra_rows(src, out_dir, ref, thresholds or DEFAULT_THRESHOLDS, progress)
    report = ParityReport(results, len(ref.prompts), n_new, len(ref.texts) - len(ref.prompts))
    if write:
        (out_dir / PARITY_JSON).write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
        (out_dir / PARITY_MD).write_text("# Parity\n\n" + report.markdown(), encoding="utf-8")
    return report

"""Cross-backend parity: every exported file against the PyTorch fp32 checkpoint it came from.

Backends (whatever the manifest lists): safetensors reload (our model on the HF weights), transformers,
ONNX (fp32/int8/int4, through serving.load), llama.cpp (F32/F16/Q8_0/Q4_K_M/..., through
serving.llamacpp). For each, over a fixed prompt set (Bangla prose and news, both Unicode spellings of
ড় ঢ় য়, ZWJ/ZWNJ, Bangla and ASCII digits, English, code-mixed text, emoji, whitespace runs, one prompt
near the context length):

- max |logit difference|, mean KL(reference || backend) over all positions, top-1 agreement,
  all on the same token ids (the training tokenizer's);
- identical greedy continuation length over `n_new` new tokens;
- tokenizer parity: the backend's own tokenizer gives the training tokenizer's ids on every prompt
  (plus a chat prompt with special tokens, plus any extra texts);
- full-sequence vs incremental (KV-cache) decoding inside the backend.

Thresholds (DEFAULT_THRESHOLDS, overridable per `kind.metric`) are judged on a trained model:
random weights give flat distributions where top-1 agreement means nothing.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from export import ExportError
from export.manifest import Manifest, Source, load_source
from export.names import from_hf
from serving.backend import SamplingParams
from training import checkpoint
from training.chat import render
from training.model import Transformer
from training.text import normalize
from training.tokenizer import BOS, Tokenizer

PARITY_JSON, PARITY_MD = "parity.json", "parity.md"
DEFAULT_NEW_TOKENS = 16
GREEDY_PROMPTS = 4  # greedy continuations from the first few prompts (each costs n_new decode steps)
CONTEXT_MARGIN = 8  # the long prompt stops this many tokens short of the context length
FP32_MAX_ABS = 1e-4
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


# ------------------------------------------------------------------------------------------ metrics
def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kl_rows(ref: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(other)) for every row."""
    lp, lq = log_softmax(ref), log_softmax(other)
    return (np.exp(lp) * (lp - lq)).sum(-1)


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


# ------------------------------------------------------------------------------------------ runners
@dataclass
class Runner:
    """One backend under test, as plain callables (so serving backends, transformers and our own
    model fit the same comparison)."""

    name: str
    kind: str
    file: str
    logits: Callable[[list[int]], np.ndarray]
    greedy: Callable[[list[int], int], list[int]]
    tokenize: Callable[[str, bool], list[int]] | None = None  # (text, allow_special) -> ids with <s>
    incremental: Callable[[list[int]], np.ndarray] | None = None  # KV-cache decoding of the same ids
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)


def _torch_runner(model: Transformer, eos_ids: Sequence[int]) -> tuple[Callable, Callable, Callable]:
    @torch.no_grad()
    def logits(ids: list[int]) -> np.ndarray:
        return model(torch.tensor([ids])).float()[0].numpy()

    @torch.no_grad()
    def incremental(ids: list[int]) -> np.ndarray:  # first half in one pass, the rest one by one
        prefix = max(1, len(ids) // 2)
        x = torch.tensor([ids])
        out, past = model.forward_with_cache(x[:, :prefix], torch.arange(prefix)[None], None)
        rows = [out[0]]
        for i in range(prefix, len(ids)):
            out, past = model.forward_with_cache(x[:, i:i + 1], torch.tensor([[i]]), past)
            rows.append(out[0])
        return torch.cat(rows).numpy()

    @torch.no_grad()
    def greedy(ids: list[int], n: int) -> list[int]:
        out, past = model.forward_with_cache(torch.tensor([ids]), torch.arange(len(ids))[None], None)
        new: list[int] = []
        for _ in range(n):
            t = int(out[0, -1].argmax())
            if t in eos_ids:
                break
            new.append(t)
            pos = len(ids) + len(new) - 1
            if pos >= model.cfg.max_seq_len:
                break
            out, past = model.forward_with_cache(torch.tensor([[t]]), torch.tensor([[pos]]), past)
        return new

    return logits, incremental, greedy


def reference_runner(src: Source) -> Runner:
    model = src.model()
    tok = src.tokenizer
    logits, incremental, greedy = _torch_runner(model, (tok.eos_id, tok.im_end_id))
    return Runner("pytorch (reference)", "reference", str(src.path), logits, greedy,
                  lambda t, s: tok.encode(t, bos=True, allow_special=s), incremental)


def safetensors_runner(src: Source, hf_dir: Path) -> Runner:
    """Our own model on the exported HF weights (names mapped back): must be bit-exact."""
    from safetensors.torch import load_file

    weights = {from_hf(k): v for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    model = Transformer(src.config)
    checkpoint.load_weights(model, weights)
    model.eval()
    tok = Tokenizer.load(hf_dir / "tokenizer.model")
    logits, incremental, greedy = _torch_runner(model, (tok.eos_id, tok.im_end_id))
    return Runner("safetensors reload", "safetensors", str(hf_dir / "model.safetensors"), logits, greedy,
                  lambda t, s: tok.encode(t, bos=True, allow_special=s), incremental)


def transformers_runner(src: Source, hf_dir: Path) -> Runner:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # transformers 5 renames past_key_values; the old name still works in 4.x and 5.x
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
    hf_tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    eos = (src.tokenizer.eos_id, src.tokenizer.im_end_id)

    @torch.no_grad()
    def logits(ids: list[int]) -> np.ndarray:
        return model(torch.tensor([ids]), use_cache=False).logits.float()[0].numpy()

    @torch.no_grad()
    def incremental(ids: list[int]) -> np.ndarray:
        prefix = max(1, len(ids) // 2)
        out = model(torch.tensor([ids[:prefix]]), use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for i in ids[prefix:]:
            out = model(torch.tensor([[i]]), past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
        return torch.cat(rows).float().numpy()

    @torch.no_grad()
    def greedy(ids: list[int], n: int) -> list[int]:
        out = model(torch.tensor([ids]), use_cache=True)
        new: list[int] = []
        for _ in range(n):
            t = int(out.logits[0, -1].argmax())
            if t in eos or len(ids) + len(new) >= src.config.max_seq_len:
                break
            new.append(t)
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
        return new

    def tokenize(text: str, allow_special: bool) -> list[int]:
        # transformers does not apply NFC: callers normalize first, as every prodip path does
        text = normalize(text)
        if allow_special:
            return hf_tok(text)["input_ids"]
        return [hf_tok.bos_token_id, *hf_tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]]

    r = Runner("transformers", "transformers", str(hf_dir), logits, greedy, tokenize, incremental)
    r.notes.append("transformers' tokenizer does not apply NFC; the comparison feeds it normalize(text)")
    return r


def backend_runner(backend, file: str) -> Runner:
    """Any serving.backend.Backend (llama.cpp, ONNX Runtime)."""
    def greedy(ids: list[int], n: int) -> list[int]:
        return list(backend.generate(ids, SamplingParams.greedy(n)))

    inc = getattr(backend, "logits_incremental", None)
    return Runner(backend.name, backend.name, file, lambda ids: np.asarray(backend.logits(ids), np.float32), greedy,
                  lambda t, s: list(backend.tokenize(t, bos=True, allow_special=s)), inc, backend.close)


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
    def build(cls, runner: Runner, tok: Tokenizer, n_ctx: int, *, n_new: int, extra_texts: Iterable[str]) -> Reference:
        prompts = prompt_set(tok, n_ctx)
        ids = [tok.encode(p, bos=True) for p in prompts]
        logits = [runner.logits(i) for i in ids]
        greedy = [runner.greedy(i, n_new) for i in ids[:GREEDY_PROMPTS]]
        return cls(tok, prompts, ids, logits, greedy, n_new, [*prompts, *extra_texts])


def _limits(kind: str, thresholds: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    return dict(thresholds.get(kind, {}))


def compare(ref: Reference, r: Runner, thresholds: Mapping[str, Mapping[str, float]] = DEFAULT_THRESHOLDS) -> dict:
    """All metrics of one runner against the reference, with verdicts."""
    max_abs, kls, agree, n_pos = 0.0, [], 0, 0
    for ids, rl in zip(ref.ids, ref.logits, strict=True):
        bl = r.logits(ids)
        if bl.shape != rl.shape:
            raise ParityError(f"{r.name}: logits of shape {bl.shape}, expected {rl.shape}")
        max_abs = max(max_abs, float(np.abs(bl.astype(np.float64) - rl).max()))
        kls.append(kl_rows(rl, bl))
        agree += int((bl.argmax(-1) == rl.argmax(-1)).sum())
        n_pos += len(ids)
    kl = float(np.concatenate(kls).mean())
    top1 = agree / n_pos
    if not math.isfinite(max_abs):
        max_abs = float("inf")

    # greedy continuation
    g_match, g_total = 0, 0  # identical leading tokens / reference tokens (it may stop early at </s>)
    for ids, want in zip(ref.ids, ref.greedy, strict=False):
        got = r.greedy(ids, ref.n_new)
        same = 0
        for a, b in zip(want, got, strict=False):
            if a != b:
                break
            same += 1
        g_match += same
        g_total += len(want)

    # tokenizer parity
    tok_equal, tok_total, tok_mismatch = 0, 0, []
    if r.tokenize is not None:
        cases = [(t, False) for t in ref.texts] + [(CHAT_PROMPT, True)]
        for text, special in cases:
            want = ref.tok.encode(text, bos=True, allow_special=special)
            got = r.tokenize(text, special)
            tok_total += 1
            if list(got) == want:
                tok_equal += 1
            elif len(tok_mismatch) < 3:
                tok_mismatch.append({"text": text[:60], "want": want[:12], "got": list(got)[:12]})

    # full vs incremental decoding within the backend
    inc = None
    if r.incremental is not None:
        ids = ref.ids[0]
        full = r.logits(ids)
        step = r.incremental(ids)
        inc = {"max_abs": float(np.abs(full.astype(np.float64) - step).max()), "kl": float(kl_rows(full, step).mean())}

    limits = _limits(r.kind, thresholds)
    failures = []
    measured = {"max_abs": max_abs, "kl": kl, "top1": top1}
    for metric, limit in limits.items():
        v = measured[metric]
        ok = v >= limit if metric in LOWER_BOUNDS else v <= limit
        if not ok:
            op = ">=" if metric in LOWER_BOUNDS else "<="
            failures.append(f"{metric} {v:.3g} not {op} {limit:g}")
    if r.tokenize is not None and tok_equal != tok_total:
        failures.append(f"tokenizer ids differ on {tok_total - tok_equal} of {tok_total} texts")
    if inc is not None:
        if r.kind in FP32_KINDS and inc["max_abs"] > FP32_MAX_ABS:
            failures.append(f"incremental decoding max_abs {inc['max_abs']:.3g} > {FP32_MAX_ABS:g}")
        inc_kl = max(INCREMENTAL_KL, INCREMENTAL_KL_SHARE * limits.get("kl", 0.0))
        if inc["kl"] > inc_kl:
            failures.append(f"incremental decoding KL {inc['kl']:.3g} > {inc_kl:g}")
    return {
        "name": r.name, "kind": r.kind, "file": r.file,
        "max_abs": max_abs, "kl": kl, "top1": top1, "positions": n_pos,
        "greedy_match": g_match, "greedy_total": g_total,
        "tokenizer_equal": tok_equal if r.tokenize is not None else None, "tokenizer_total": tok_total or None,
        "tokenizer_mismatches": tok_mismatch,
        "incremental": inc, "thresholds": limits, "notes": r.notes,
        "passed": not failures, "failures": failures,
    }


# -------------------------------------------------------------------------------------- orchestration
def discover(src: Source, out_dir: Path, manifest: Manifest) -> list[Callable[[], Runner]]:
    """Runner factories for every exported file the manifest lists (loaded one at a time)."""
    factories: list[Callable[[], Runner]] = []
    hf = manifest.files("hf")
    if "hf/model.safetensors" in hf:
        hf_dir = out_dir / "hf"
        factories.append(lambda: safetensors_runner(src, hf_dir))
        try:
            import transformers  # noqa: F401
        except ImportError:
            pass
        else:
            factories.append(lambda: transformers_runner(src, hf_dir))
    from serving.backend import load

    for rel, entry in sorted(manifest.files().items()):
        if entry["format"] in ("onnx", "gguf") and rel.endswith((".onnx", ".gguf")):
            path = out_dir / rel
            factories.append(lambda path=path: backend_runner(load(path), str(path)))
    return factories


@dataclass
class ParityReport:
    results: list[dict]
    prompts: int
    n_new: int
    extra_texts: int

    @property
    def passed(self) -> bool:
        return all(r["passed"] for r in self.results)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "prompts": self.prompts, "new_tokens": self.n_new,
                "extra_texts": self.extra_texts, "backends": self.results}

    def table(self) -> str:
        rows = ["| backend | max abs Δlogit | mean KL | top-1 | greedy match | tokenizer | incremental Δ | thresholds | result |",
                "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for r in self.results:
            tok = f"{r['tokenizer_equal']}/{r['tokenizer_total']}" if r["tokenizer_total"] else "n/a"
            inc = f"{r['incremental']['max_abs']:.2e}" if r["incremental"] else "n/a"
            th = ", ".join(f"{k} {'≥' if k in LOWER_BOUNDS else '≤'} {v:g}" for k, v in r["thresholds"].items()) or "report only"
            verdict = "pass" if r["passed"] else "FAIL: " + "; ".join(r["failures"])
            rows.append(f"| {r['name']} | {r['max_abs']:.2e} | {r['kl']:.2e} | {r['top1']:.1%} | "
                        f"{r['greedy_match']}/{r['greedy_total']} | {tok} | {inc} | {th} | {verdict} |")
        return "\n".join(rows)

    def markdown(self) -> str:
        head = (f"Reference: the PyTorch fp32 checkpoint. {self.prompts} prompts (same token ids for every "
                f"backend), greedy continuations of {self.n_new} tokens, tokenizer parity on "
                f"{self.prompts + self.extra_texts + 1} texts (incl. one chat prompt).")
        verdict = "**all thresholds met**" if self.passed else "**THRESHOLDS BREACHED**"
        return f"{head}\n\n{self.table()}\n\n{verdict}\n"


def parse_thresholds(items: Iterable[str]) -> dict[str, dict[str, float]]:
    """DEFAULT_THRESHOLDS with `kind.metric=value` overrides (e.g. llama.cpp-Q4_K_M.kl=0.08)."""
    out = {k: dict(v) for k, v in DEFAULT_THRESHOLDS.items()}
    for item in items:
        key, _, value = item.partition("=")
        kind, _, metric = key.rpartition(".")
        if not kind or metric not in ("max_abs", "kl", "top1") or not value:
            raise ParityError(f"bad threshold {item!r}; use KIND.METRIC=VALUE with METRIC max_abs, kl or top1")
        try:
            out.setdefault(kind, {})[metric] = float(value)
        except ValueError:
            raise ParityError(f"bad threshold value in {item!r}") from None
    return out


def run_parity(out_dir: Path, src: Source | None = None, *, thresholds: Mapping[str, Mapping[str, float]] | None = None,
               n_new: int = DEFAULT_NEW_TOKENS, extra_texts: Sequence[str] = (), write: bool = True,
               runners: Sequence[Runner] | None = None, progress: Callable[[str], None] | None = None) -> ParityReport:
    """Compare every export listed in out_dir/manifest.json (or the given `runners`) with the checkpoint.

    Writes parity.json and parity.md into out_dir when `write`."""
    manifest = Manifest.read(out_dir) if runners is None or src is None else None
    if src is None:
        src = load_source(manifest.data["source"]["checkpoint"])
        if src.tokenizer.sha256 != manifest.data["tokenizer_sha256"]:
            raise ParityError(f"{out_dir}: the source checkpoint's tokenizer changed since the export")
    thresholds = thresholds or DEFAULT_THRESHOLDS
    ref_runner = reference_runner(src)
    ref = Reference.build(ref_runner, src.tokenizer, src.config.max_seq_len, n_new=n_new,
                          extra_texts=[normalize(t) for t in extra_texts if t])
    results = []
    sources: list = list(runners) if runners is not None else discover(src, out_dir, manifest)
    for item in sources:
        r = item if isinstance(item, Runner) else item()
        try:
            if progress:
                progress(f"parity: {r.name}")
            results.append(compare(ref, r, thresholds))
        finally:
            if runners is None:
                r.close()
    report = ParityReport(results, len(ref.prompts), n_new, len(ref.texts) - len(ref.prompts))
    if write:
        (out_dir / PARITY_JSON).write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
        (out_dir / PARITY_MD).write_text("# Parity\n\n" + report.markdown(), encoding="utf-8")
    return report

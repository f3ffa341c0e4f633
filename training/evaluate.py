"""Evaluation: bits per byte, the random-init twin and multiple choice, over a log-probability provider.

Per-token NLL depends on the tokenizer (the very thing the fertility trap changes), so every language
modelling number also comes as bits per byte and bits per character of the normalized text:

    bits/byte = sum over scored tokens of -ln p(token | prefix)  /  ln 2  /  UTF-8 bytes of the text

Every document is scored as <s> + tokens, and every token after <s> is counted (the first one too),
so the scored tokens cover all bytes. Documents longer than the context are scored in overlapping
windows (stride), each token once, with at least n_ctx - stride tokens of context.

The metric code knows no runtime: it takes a `LogProbProvider` (PyTorch here as `TorchProvider`;
GGUF/ONNX through `export.evaluate`), so quantization loss shows up as a bits-per-byte delta.

    python -m training.evaluate RUN_OR_CHECKPOINT [--text FILE ...] [--mc FILE_OR_DIR ...] [--limit N]

writes eval.json, eval.md and eval.png (RUN/eval by default) and, for a run, a section of the model
card RUN/export/README.md when that file exists.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.cli import guarded
from training.gates import GateResult
from training.model import ModelConfig, Transformer
from training.text import detect_language, normalize, read_utf8, script_counts
from training.tokenizer import Tokenizer

LN2 = math.log(2.0)
WILSON_Z = 1.959963984540054  # two-sided 95% normal quantile
TWIN_SEED = 0  # the random-init twin is always built from this seed unless asked otherwise
TWIN_MARGIN = 1.0  # nats/token the trained model must beat its twin by
MAX_DOC_CHARS = 4096  # consecutive same-language lines are grouped into documents up to this size
LOGIT_BUDGET = 1 << 26  # fp32 logit elements per forward chunk (256 MiB)
GATE_BATCH = 8  # windows per forward in the twin gate
EVAL_FORMAT = 1
ALL = "all"
MC_EXTENSIONS = (".json", ".jsonl")
CARD_MARKER = "eval"  # card section markers: <!-- prodip:eval:begin --> ... <!-- prodip:eval:end -->
OKAPI_LETTERS = "abcdefgh"


class EvalError(ValueError):
    pass


# --------------------------------------------------------------------------------------------------
# Providers


@runtime_checkable
class LogProbProvider(Protocol):
    """What the metrics need from a model: its tokenizer and per-position log-probabilities.

    `token_logprobs(ids)` returns a float array of length len(ids) - 1 whose entry i - 1 is
    log p(ids[i] | ids[:i]) for i >= 1; len(ids) <= n_ctx. A provider may also offer
    `token_logprobs_batch(list_of_ids) -> list of arrays` plus `max_batch_tokens` (padded tokens per
    call) to score many sequences per forward pass.
    """

    name: str
    n_ctx: int
    bos_id: int

    def encode(self, text: str) -> list[int]: ...  # normalized text -> ids, without <s>/</s>

    def token_logprobs(self, ids: Sequence[int]) -> np.ndarray: ...


class TorchProvider:
    """A `Transformer` and its tokenizer as a LogProbProvider: batched (right-padded), fp32 log-softmax."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, name: str = "model",
                 max_batch_tokens: int | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.n_ctx = model.cfg.max_seq_len
        self.bos_id = tokenizer.bos_id
        self.device = next(model.parameters()).device
        self.max_batch_tokens = max_batch_tokens or max(self.n_ctx, LOGIT_BUDGET // model.cfg.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def token_logprobs(self, ids: Sequence[int]) -> np.ndarray:
        return self.token_logprobs_batch([ids])[0]

    @torch.no_grad()
    def token_logprobs_batch(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        lengths = [len(s) for s in seqs]
        if min(lengths) < 1 or max(lengths) > self.n_ctx:
            raise EvalError(f"sequence lengths must be in [1, {self.n_ctx}], got {min(lengths)}..{max(lengths)}")
        x = torch.full((len(seqs), max(lengths)), self.tokenizer.pad_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            x[b, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        x = x.to(self.device)
        # Right padding is invisible to a causal model at the real positions.
        logits = self.model(x)[:, :-1].float()
        lp = F.log_softmax(logits, dim=-1).gather(-1, x[:, 1:, None]).squeeze(-1).double().cpu().numpy()
        return [lp[b, : n - 1] for b, n in enumerate(lengths)]


@dataclass(frozen=True)
class Span:
    """One sequence to score: log-probabilities of ids[start:] (start >= 1) given what precedes."""

    ids: tuple[int, ...]
    start: int


def windows(ids: Sequence[int], n_ctx: int, stride: int | None = None) -> list[Span]:
    """Overlapping windows that score positions 1..len(ids)-1 exactly once each."""
    ids = tuple(ids)
    stride = stride or max(1, n_ctx // 2)
    if not 1 <= stride <= n_ctx - 1:
        raise EvalError(f"stride must be in [1, {n_ctx - 1}] for a context of {n_ctx}, got {stride}")
    if len(ids) <= n_ctx:
        return [Span(ids, 1)]
    spans = [Span(ids[:n_ctx], 1)]
    end = n_ctx
    while end < len(ids):
        new_end = min(end + stride, len(ids))
        begin = new_end - n_ctx
        spans.append(Span(ids[begin:new_end], end - begin))
        end = new_end
    return spans


def score_spans(provider: LogProbProvider, spans: Sequence[Span], *, desc: str = "scoring",
                progress: bool = True) -> list[np.ndarray]:
    """Log-probabilities of each span's scored tokens, batched when the provider can batch."""
    out: list[np.ndarray | None] = [None] * len(spans)
    batch_fn = getattr(provider, "token_logprobs_batch", None)
    budget = int(getattr(provider, "max_batch_tokens", 0) or 0)
    order = sorted(range(len(spans)), key=lambda i: -len(spans[i].ids))  # similar lengths pad less
    with tqdm(total=len(spans), desc=desc, unit="seq", disable=not progress, leave=False) as bar:
        k = 0
        while k < len(order):
            if batch_fn is not None and budget:
                width = len(spans[order[k]].ids)  # longest of the rest: sorted descending
                group = order[k: k + max(1, budget // max(1, width))]
                results = batch_fn([spans[i].ids for i in group])
            else:
                group = order[k: k + 1]
                results = [provider.token_logprobs(spans[group[0]].ids)]
            for i, lp in zip(group, results):
                lp = np.asarray(lp, dtype=np.float64)
                if lp.shape != (len(spans[i].ids) - 1,):
                    raise EvalError(f"provider {provider.name} returned {lp.shape} log-probs for {len(spans[i].ids)} tokens")
                out[i] = lp[spans[i].start - 1:]
            k += len(group)
            bar.update(len(group))
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# Language modelling: NLL per token, bits per byte and per character, by language


@dataclass
class LMStats:
    docs: int = 0
    tokens: int = 0
    bytes: int = 0
    chars: int = 0
    nll: float = 0.0  # summed, nats

    def add(self, other: LMStats) -> None:
        self.docs += other.docs
        self.tokens += other.tokens
        self.bytes += other.bytes
        self.chars += other.chars
        self.nll += other.nll

    @property
    def nll_per_token(self) -> float:
        return self.nll / self.tokens if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        return self.nll / LN2 / self.bytes if self.bytes else float("nan")

    @property
    def bits_per_char(self) -> float:
        return self.nll / LN2 / self.chars if self.chars else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_per_token) if self.tokens else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else float("nan")

    def to_dict(self) -> dict:
        return {"docs": self.docs, "tokens": self.tokens, "bytes": self.bytes, "chars": self.chars,
                "nll_sum": self.nll, "nll_per_token": self.nll_per_token, "bits_per_byte": self.bits_per_byte,
                "bits_per_char": self.bits_per_char, "perplexity": self.perplexity,
                "bytes_per_token": self.bytes_per_token}


def split_documents(text: str, max_chars: int = MAX_DOC_CHARS) -> list[tuple[str, str]]:
    """Normalize `text` and cut it into (language, document) pieces that concatenate back to it.

    Each line gets `detect_language`; lines without letters (blank, digits, punctuation) join the
    current document. A document ends where the language changes or it would exceed max_chars.
    """
    text = normalize(text)
    docs: list[tuple[str, str]] = []
    lang: str | None = None
    buf: list[str] = []
    size = 0
    lines = text.split("\n")
    for n, line in enumerate(lines):
        if n < len(lines) - 1:
            line += "\n"
        if not line:
            continue
        line_lang = detect_language(line) if sum(script_counts(line).values()) else None
        switch = line_lang is not None and lang is not None and line_lang != lang
        if buf and (switch or size + len(line) > max_chars):
            docs.append((lang or "other", "".join(buf)))
            buf, size, lang = [], 0, None
        buf.append(line)
        size += len(line)
        if lang is None:
            lang = line_lang
    if buf:
        docs.append((lang or "other", "".join(buf)))
    return docs


def evaluate_lm(provider: LogProbProvider, docs: Sequence[tuple[str, str]], *, stride: int | None = None,
                progress: bool = True) -> dict[str, LMStats]:
    """LMStats per language and for ALL of them, each document scored as <s> + its tokens."""
    spans: list[Span] = []
    owner: list[int] = []
    per_doc: list[LMStats] = []
    for d, (_, doc) in enumerate(docs):
        ids = [provider.bos_id, *provider.encode(doc)]
        st = LMStats(docs=1, tokens=len(ids) - 1, bytes=len(doc.encode("utf-8")), chars=len(doc))
        per_doc.append(st)
        if len(ids) < 2:
            continue
        ws = windows(ids, provider.n_ctx, stride)
        spans.extend(ws)
        owner.extend([d] * len(ws))
    for d, lp in zip(owner, score_spans(provider, spans, desc=f"{provider.name}: text", progress=progress)):
        per_doc[d].nll -= float(lp.sum())
    out: dict[str, LMStats] = {}
    for (lang, _), st in zip(docs, per_doc):
        out.setdefault(lang, LMStats()).add(st)
        out.setdefault(ALL, LMStats()).add(st)
    return out


def read_text_docs(paths: Sequence[str | Path], max_chars: int = MAX_DOC_CHARS,
                   limit_chars: int | None = None) -> list[tuple[str, str]]:
    docs: list[tuple[str, str]] = []
    for p in paths:
        text = read_utf8(p, "text file", EvalError)
        if limit_chars:
            text = text[:limit_chars]
        docs.extend(split_documents(text, max_chars))
    if not docs:
        raise EvalError(f"no text to score in {', '.join(map(str, paths))}")
    return docs


# --------------------------------------------------------------------------------------------------
# The random-initialized twin


def make_twin(cfg: ModelConfig, seed: int = TWIN_SEED, device: torch.device | str = "cpu") -> Transformer:
    """The same architecture, freshly initialized from a fixed seed (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin = Transformer(cfg)
    return twin.to(device).eval()


def _as_batches(token_windows, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) batches from a 2-D tensor/array of windows, 1-D windows, or (x, y) pairs."""
    if isinstance(token_windows, (torch.Tensor, np.ndarray)):
        token_windows = torch.as_tensor(np.asarray(token_windows) if isinstance(token_windows, np.ndarray)
                                        else token_windows)
        if token_windows.dim() != 2:
            raise EvalError(f"token windows must be 2-D (N, T), got shape {tuple(token_windows.shape)}")
        token_windows = list(token_windows)
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending: list[torch.Tensor] = []

    def flush() -> None:
        if pending:
            w = torch.stack(pending).long()
            batches.append((w[:, :-1], w[:, 1:]))
            pending.clear()

    for item in token_windows:
        if isinstance(item, (tuple, list)) and len(item) == 2 and all(torch.is_tensor(t) for t in item):
            x, y = (t.long() for t in item)  # WindowLoader.next_batch() output
            x, y = (x[None], y[None]) if x.dim() == 1 else (x, y)
            batches.append((x, y))
            continue
        w = torch.as_tensor(np.asarray(item, dtype=np.int64))
        if w.dim() != 1 or w.numel() < 2:
            raise EvalError("each token window must be a 1-D sequence of at least 2 ids")
        if pending and (len(pending) >= batch_size or pending[0].numel() != w.numel()):
            flush()
        pending.append(w)
    flush()
    if not batches:
        raise EvalError("no token windows to score")
    return batches


@torch.no_grad()
def window_nll(model: Transformer, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """(summed NLL in nats, token count) of targets given inputs, in fp32."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for x, y in batches:
            logits = model(x.to(device))
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1),
                                           reduction="sum"))
            count += y.numel()
    finally:
        model.train(was_training)
    return total, count


@dataclass(frozen=True)
class TwinNLL:
    model: float  # mean NLL per token, nats
    twin: float
    tokens: int
    seed: int

    @property
    def gap(self) -> float:
        return self.twin - self.model


def nll_twin(model: Transformer, cfg: ModelConfig | None, token_windows, *, seed: int = TWIN_SEED,
             batch_size: int = GATE_BATCH) -> TwinNLL:
    """Mean NLL per token of `model` and of its random-init twin (same config, fixed seed) on the same windows.

    token_windows: a 2-D tensor/array (N, T) of token windows, an iterable of 1-D windows, or an iterable
    of (inputs, targets) batches as `training.data.WindowLoader.next_batch` returns them.
    """
    cfg = cfg or model.cfg
    batches = _as_batches(token_windows, batch_size)
    m_sum, n = window_nll(model, batches)
    twin = make_twin(cfg, seed, next(model.parameters()).device)
    t_sum, _ = window_nll(twin, batches)
    return TwinNLL(m_sum / n, t_sum / n, n, seed)


def twin_result(model_nll: float, twin_nll: float, tokens: int, *, margin: float = TWIN_MARGIN,
                seed: int = TWIN_SEED, what: str = "held-out") -> GateResult:
    gap = twin_nll - model_nll
    passed = math.isfinite(gap) and gap >= margin
    return GateResult(
        name="twin", passed=passed, value=round(model_nll, 4),
        threshold=f"<= twin - {margin:g} nat/token",
        detail=(f"{what} NLL {model_nll:.3f} vs random-init twin {twin_nll:.3f} (seed {seed}) over {tokens} tokens: "
                f"gap {gap:.3f} nat/token" + ("" if passed else f" < margin {margin:g}: the model has not learned")))


def twin_gate(model: Transformer, cfg: ModelConfig | None, token_windows, *, margin: float = TWIN_MARGIN,
              seed: int = TWIN_SEED, batch_size: int = GATE_BATCH) -> GateResult:
    """Gate "twin": held-out NLL must be at least `margin` nats/token below the random-init twin's."""
    r = nll_twin(model, cfg, token_windows, seed=seed, batch_size=batch_size)
    return twin_result(r.model, r.twin, r.tokens, margin=margin, seed=seed)


# --------------------------------------------------------------------------------------------------
# Multiple choice


@dataclass
class MCItem:
    """contexts[j] + continuations[j] is choice j; only the continuation is scored."""

    contexts: list[str]
    continuations: list[str]
    gold: int

    @property
    def n_choices(self) -> int:
        return len(self.continuations)


def _join(context: str, choice: str) -> str:
    """The continuation as scored: a space separates it from the context unless whitespace already does."""
    return choice if (not context or context[-1].isspace() or choice[:1].isspace()) else " " + choice


def _hellaswag_clean(text: str) -> str:
    # As lm-evaluation-harness preprocesses HellaSwag (WikiHow artifacts).
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _item(context: str | list[str], choices: list[str], gold: int) -> MCItem:
    contexts = context if isinstance(context, list) else [context] * len(choices)
    return MCItem(contexts, [_join(c, ch) for c, ch in zip(contexts, choices)], gold)


def parse_mc_record(rec: dict) -> tuple[str, MCItem]:
    """(format name, item) for one record of a supported format; EvalError otherwise."""
    if not isinstance(rec, dict):
        raise EvalError(f"expected a JSON object, got {type(rec).__name__}")
    if {"query", "choices", "gold"} <= rec.keys():
        return "llm-foundry", _item(rec["query"], list(rec["choices"]), rec["gold"])
    if {"context_options", "continuation", "gold"} <= rec.keys():  # Winogrande: shared continuation
        ctxs = list(rec["context_options"])
        return "winogrande", _item(ctxs, [rec["continuation"]] * len(ctxs), rec["gold"])
    if {"ctx", "endings", "label"} <= rec.keys():
        return "hellaswag", _item(_hellaswag_clean(rec["ctx"]), [_hellaswag_clean(e) for e in rec["endings"]],
                                  rec["label"])
    if {"instruction", "option_a", "answer"} <= rec.keys():  # Okapi m_ARC, lm-evaluation-harness's prompt
        opts = [rec[f"option_{c}"] for c in OKAPI_LETTERS if rec.get(f"option_{c}")]
        letter = str(rec["answer"]).strip().lower()
        if len(letter) != 1 or letter not in OKAPI_LETTERS:
            raise EvalError(f"answer must be a letter A-{OKAPI_LETTERS[len(opts) - 1].upper()}, got {rec['answer']!r}")
        return "okapi-arc", _item(f"Question: {rec['instruction']}\nAnswer:", opts, OKAPI_LETTERS.index(letter))
    raise EvalError(f"unknown multiple-choice record with keys {sorted(rec)}; expected query/choices/gold, "
                    "context_options/continuation/gold, ctx/endings/label or instruction/option_a../answer")


def _validate(item: MCItem) -> MCItem:
    if item.n_choices < 2:
        raise EvalError(f"needs at least 2 choices, got {item.n_choices}")
    if not all(isinstance(s, str) for s in (*item.contexts, *item.continuations)):
        raise EvalError("contexts and choices must be strings")
    try:
        gold = int(item.gold)
    except (TypeError, ValueError):
        raise EvalError(f"gold must be an integer index, got {item.gold!r}") from None
    if not 0 <= gold < item.n_choices:
        raise EvalError(f"gold index {gold} out of range for {item.n_choices} choices")
    item.gold = gold
    return item


def load_mc(path: str | Path, limit: int | None = None) -> tuple[str, list[MCItem]]:
    """Items of a multiple-choice file (JSONL records, or one JSON list) and their format name."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"multiple-choice file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"{p}: not UTF-8 ({e})") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise EvalError(f"{p}: invalid JSON ({e})") from None
        where = [f"item {i}" for i in range(len(records))]
    else:
        records, where = [], []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise EvalError(f"{p}:{n}: invalid JSON ({e})") from None
                where.append(f"line {n}")
    if limit:
        records, where = records[:limit], where[:limit]
    formats, items = set(), []
    for rec, w in zip(records, where):
        try:
            fmt, item = parse_mc_record(rec)
            items.append(_validate(item))
        except EvalError as e:
            raise EvalError(f"{p} {w}: {e}") from None
        except (TypeError, KeyError, AttributeError) as e:
            raise EvalError(f"{p} {w}: malformed record ({e})") from None
        formats.add(fmt)
    if not items:
        raise EvalError(f"{p}: no multiple-choice items")
    return "+".join(sorted(formats)), items


def mc_set_name(path: str | Path) -> str:
    """A short name for a file: 'llm-foundry__arc_easy.jsonl' -> 'arc_easy' (the source prefix dropped)."""
    stem = Path(path).name.split(".")[0]
    return stem.split("__", 1)[-1].replace("__", "_")


def wilson_interval(correct: int, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (well-behaved at small n and near 0 or 1)."""
    if n <= 0:
        return (float("nan"), float("nan"))
    p = correct / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


def chance_rate(items: Sequence[MCItem]) -> float:
    """Expected accuracy of uniform guessing: the mean of 1/n_choices."""
    return sum(1.0 / it.n_choices for it in items) / len(items) if items else float("nan")


SCORE_KINDS = {"acc": "sum log-likelihood", "acc_norm_char": "log-likelihood per character",
               "acc_norm_byte": "log-likelihood per UTF-8 byte"}


@dataclass
class MCScores:
    """Per item and choice: summed log-likelihood of the continuation, its chars and bytes."""

    items: list[MCItem]
    loglik: list[list[float]]
    chars: list[list[int]]
    bytes: list[list[int]]
    truncated: int = 0

    def predictions(self, kind: str = "acc") -> list[int]:
        preds = []
        for ll, ch, by in zip(self.loglik, self.chars, self.bytes):
            if kind == "acc":
                s = ll
            elif kind == "acc_norm_char":
                s = [v / max(1, c) for v, c in zip(ll, ch)]
            elif kind == "acc_norm_byte":
                s = [v / max(1, b) for v, b in zip(ll, by)]
            else:
                raise EvalError(f"unknown score kind {kind!r}")
            preds.append(int(np.argmax(s)))
        return preds

    def summary(self) -> dict:
        n = len(self.items)
        out: dict = {"n": n, "ways": dict(sorted(Counter(str(it.n_choices) for it in self.items).items())),
                     "chance": chance_rate(self.items), "truncated": self.truncated}
        for kind in SCORE_KINDS:
            correct = sum(int(p == it.gold) for p, it in zip(self.predictions(kind), self.items))
            lo, hi = wilson_interval(correct, n)
            out[kind] = {"correct": correct, "value": correct / n if n else float("nan"), "ci95": [lo, hi]}
        return out


def score_mc(provider: LogProbProvider, items: Sequence[MCItem], *, desc: str = "mc",
             progress: bool = True) -> MCScores:
    """Log-likelihood of every choice's continuation given <s> + its context (left-truncated to n_ctx)."""
    cache: dict[str, list[int]] = {}

    def enc(s: str) -> list[int]:
        if s not in cache:
            cache[s] = provider.encode(s)
        return cache[s]

    spans: list[Span] = []
    truncated = 0
    for it in items:
        for ctx, cont in zip(it.contexts, it.continuations):
            ctx_ids, cont_ids = enc(ctx), enc(cont)
            if not cont_ids:
                raise EvalError(f"empty choice after the context {ctx[:40]!r}")
            ids = [provider.bos_id, *ctx_ids, *cont_ids]
            start = 1 + len(ctx_ids)
            if len(ids) > provider.n_ctx:  # keep the continuation and as much context as fits
                cut = len(ids) - provider.n_ctx
                ids, start = ids[cut:], max(1, start - cut)
                truncated += 1
            spans.append(Span(tuple(ids), start))
    lps = score_spans(provider, spans, desc=f"{provider.name}: {desc}", progress=progress)
    loglik, chars, nbytes = [], [], []
    k = 0
    for it in items:
        loglik.append([float(lp.sum()) for lp in lps[k: k + it.n_choices]])
        chars.append([len(normalize(c)) for c in it.continuations])
        nbytes.append([len(normalize(c).encode("utf-8")) for c in it.continuations])
        k += it.n_choices
    return MCScores(list(items), loglik, chars, nbytes, truncated)


def expand_mc_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Files as given; folders expand to their *.json / *.jsonl files."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in MC_EXTENSIONS and f.is_file())
            if not found:
                raise EvalError(f"no *.json/*.jsonl multiple-choice files in {p}")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise EvalError(f"multiple-choice file not found: {p}")
    return out


# --------------------------------------------------------------------------------------------------
# One model on the requested data, and the report


@dataclass
class EvalRequest:
    docs: list[tuple[str, str]] = field(default_factory=list)
    text_files: list[str] = field(default_factory=list)
    mc_sets: list[tuple[str, str, str, list[MCItem]]] = field(default_factory=list)  # (name, path, format, items)
    stride: int | None = None


def build_request(texts: Sequence[str | Path], mc: Sequence[str | Path], *, limit: int | None = None,
                  max_doc_chars: int = MAX_DOC_CHARS, stride: int | None = None) -> EvalRequest:
    if not texts and not mc:
        raise EvalError("nothing to evaluate: give --text FILE and/or --mc FILE")
    req = EvalRequest(stride=stride)
    if texts:
        req.text_files = [str(t) for t in texts]
        # --limit N bounds text too: the first N documents' worth is read (N * max_doc_chars characters).
        req.docs = read_text_docs(texts, max_doc_chars, limit * max_doc_chars if limit else None)
        if limit:
            req.docs = req.docs[:limit]
    names: Counter[str] = Counter()
    for p in expand_mc_paths(mc):
        fmt, items = load_mc(p, limit)
        name = mc_set_name(p)
        names[name] += 1
        if names[name] > 1:
            name = f"{name}#{names[name]}"
        req.mc_sets.append((name, str(p), fmt, items))
    return req


def evaluate_model(provider: LogProbProvider, req: EvalRequest, *, mc: bool = True, progress: bool = True) -> dict:
    """{"name", "lm": {language: stats}, "mc": {set: summary}, "seconds"} for one provider."""
    t0 = time.perf_counter()
    out: dict = {"name": provider.name, "n_ctx": provider.n_ctx, "lm": {}, "mc": {}}
    if req.docs:
        stats = evaluate_lm(provider, req.docs, stride=req.stride, progress=progress)
        out["lm"] = {lang: st.to_dict() for lang, st in sorted(stats.items(), key=lambda kv: (kv[0] == ALL, kv[0]))}
    if mc:
        for name, _, _, items in req.mc_sets:
            out["mc"][name] = score_mc(provider, items, desc=name, progress=progress).summary()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def add_deltas(models: list[dict], reference: str) -> None:
    """Bits-per-byte and accuracy deltas of every model against the `reference` model (in place)."""
    ref = next((m for m in models if m["name"] == reference), None)
    if ref is None:
        return
    for m in models:
        if m is ref:
            continue
        m["delta_vs"] = reference
        m["delta"] = {
            "bits_per_byte": {lang: st["bits_per_byte"] - ref["lm"][lang]["bits_per_byte"]
                              for lang, st in m["lm"].items() if lang in ref["lm"]},
            "acc": {k: s["acc"]["value"] - ref["mc"][k]["acc"]["value"] for k, s in m["mc"].items() if k in ref["mc"]},
            "acc_norm_byte": {k: s["acc_norm_byte"]["value"] - ref["mc"][k]["acc_norm_byte"]["value"]
                              for k, s in m["mc"].items() if k in ref["mc"]},
        }


def make_report(kind: str, source: str, models: list[dict], req: EvalRequest, *, gates: Sequence[GateResult] = (),
                reference: str | None = None, extra: dict | None = None) -> dict:
    if reference:
        add_deltas(models, reference)
    return {
        "prodip_eval": EVAL_FORMAT, "kind": kind, "source": source,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "texts": req.text_files, "mc_files": {name: {"path": p, "format": f} for name, p, f, _ in req.mc_sets},
        "reference": reference, "models": models, "gates": [g.to_dict() for g in gates], **(extra or {}),
    }


def _f(x: float | None, nd: int = 3) -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _signed(x: float | None, nd: int = 3) -> str:
    return "" if x is None or not math.isfinite(x) else f"{x:+.{nd}f}"


def render_markdown(report: dict, *, heading: str = "##") -> str:
    lines = [f"{heading} Evaluation", "",
             f"Source: `{report['source']}`" + (f" (step {report['step']})" if report.get("step") is not None else ""), ""]
    models = report["models"]
    if any(m["lm"] for m in models):
        lines += [f"{heading}# Language modelling", "",
                  "Bits per byte and per character are tokenizer-independent (UTF-8 bytes / characters of the "
                  "normalized text); NLL per token and perplexity depend on the tokenizer.", "",
                  "| language | model | docs | tokens | bytes | NLL/token | bits/byte | bits/char | perplexity | Δ bits/byte |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        langs = list(dict.fromkeys(lang for m in models for lang in m["lm"]))
        for lang in langs:
            for m in models:
                st = m["lm"].get(lang)
                if not st:
                    continue
                d = m.get("delta", {}).get("bits_per_byte", {}).get(lang)
                lines.append(f"| {lang} | {m['name']} | {st['docs']} | {st['tokens']} | {st['bytes']} | "
                             f"{_f(st['nll_per_token'])} | {_f(st['bits_per_byte'])} | {_f(st['bits_per_char'])} | "
                             f"{_f(st['perplexity'], 1)} | {_signed(d, 4)} |")
        lines.append("")
    if any(m["mc"] for m in models):
        lines += [f"{heading}# Multiple choice", "",
                  "Accuracy with a 95% Wilson interval; acc ranks choices by summed log-likelihood, acc_norm by "
                  "log-likelihood per character / per byte of the choice.", "",
                  "| set | model | n | ways | chance | acc [95% CI] | acc_norm (char) | acc_norm (byte) | Δ acc |",
                  "|---|---|---:|---|---:|---|---:|---:|---:|"]
        sets = list(dict.fromkeys(k for m in models for k in m["mc"]))
        for k in sets:
            for m in models:
                s = m["mc"].get(k)
                if not s:
                    continue
                ways = ", ".join(f"{w}-way×{c}" if len(s["ways"]) > 1 else f"{w}-way" for w, c in s["ways"].items())
                a = s["acc"]
                d = m.get("delta", {}).get("acc", {}).get(k)
                lines.append(f"| {k} | {m['name']} | {s['n']} | {ways} | {_f(s['chance'])} | "
                             f"{_f(a['value'])} [{_f(a['ci95'][0])}, {_f(a['ci95'][1])}] | "
                             f"{_f(s['acc_norm_char']['value'])} | {_f(s['acc_norm_byte']['value'])} | {_signed(d)} |")
        lines.append("")
    if report.get("gates"):
        lines += [f"{heading}# Gates", "", "| gate | result | value | threshold | detail |", "|---|---|---|---|---|"]
        for g in report["gates"]:
            lines.append(f"| {g['name']} | {'pass' if g['passed'] else 'FAIL'} | {g['value']} | {g['threshold']} | {g['detail']} |")
        lines.append("")
    return "\n".join(lines)


def render_chart(report: dict, path: Path) -> None:
    """Bits per byte per language and MC accuracy (95% CI, chance marked), one bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    langs = list(dict.fromkeys(lang for m in models for lang in m["lm"]))
    sets = list(dict.fromkeys(k for m in models for k in m["mc"]))
    panels = [p for p, have in (("lm", langs), ("mc", sets)) if have]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        groups = langs if panel == "lm" else sets
        shown = [m for m in models if m[panel]]  # e.g. the twin has no multiple-choice scores
        width = 0.8 / len(shown)
        x = np.arange(len(groups))
        for i, m in enumerate(shown):
            if panel == "lm":
                vals = [m["lm"].get(g, {}).get("bits_per_byte", np.nan) for g in groups]
                ax.bar(x + i * width, vals, width, label=m["name"])
            else:
                s = [m["mc"].get(g) for g in groups]
                vals = [v["acc"]["value"] if v else np.nan for v in s]
                err = np.array([[v["acc"]["value"] - v["acc"]["ci95"][0], v["acc"]["ci95"][1] - v["acc"]["value"]]
                                if v else [0, 0] for v in s]).T
                ax.bar(x + i * width, vals, width, yerr=err, capsize=3, label=m["name"])
        if panel == "mc":
            chance = [next((m["mc"][g]["chance"] for m in shown if g in m["mc"]), np.nan) for g in groups]
            ax.hlines(chance, x - width / 2, x + width * (len(shown) - 0.5), colors="k", linestyles="dashed",
                      label="chance")
            ax.set_ylabel("accuracy (95% Wilson CI)")
            ax.set_ylim(0, 1)
            ax.set_title("multiple choice")
        else:
            ax.set_ylabel("bits per byte (lower is better)")
            ax.set_title("language modelling")
        ax.set_xticks(x + width * (len(shown) - 1) / 2, groups, rotation=30, ha="right")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


OUTPUT_FILES = ("eval.json", "eval.md", "eval.png")


def write_outputs(report: dict, out_dir: Path, *, force: bool = False) -> list[Path]:
    out_dir = Path(out_dir)
    paths = [out_dir / f for f in OUTPUT_FILES]
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise EvalError(f"{existing[0]} already exists; pass --force to overwrite or --out DIR")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps(report, indent=2, ensure_ascii=False, allow_nan=True) + "\n", encoding="utf-8")
    paths[1].write_text(render_markdown(report, heading="#") + "\n", encoding="utf-8")
    render_chart(report, paths[2])
    return paths


def card_markers(marker: str) -> tuple[str, str]:
    return f"<!-- prodip:{marker}:begin -->", f"<!-- prodip:{marker}:end -->"


def update_card(card: Path, section: str, *, marker: str = CARD_MARKER, force: bool = False) -> bool:
    """Append `section` to the model card between markers; replace a previous one only with force."""
    begin, end = card_markers(marker)
    text = card.read_text(encoding="utf-8")
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in text and end in text:
        if not force:
            raise EvalError(f"{card} already has an evaluation section; pass --force to replace it")
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    card.write_text(text, encoding="utf-8")
    return True


# --------------------------------------------------------------------------------------------------
# CLI


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """Options shared with `python -m export.evaluate`."""
    ap.add_argument("--text", nargs="+", default=[], metavar="FILE", help="UTF-8 text files for bits per byte")
    ap.add_argument("--mc", nargs="+", default=[], metavar="FILE",
                    help="multiple-choice files (llm-foundry JSONL, Winogrande, HellaSwag, Okapi ARC) or folders of them")
    ap.add_argument("--limit", type=int, default=None, metavar="N",
                    help="at most N items per multiple-choice file and N text documents")
    ap.add_argument("--out", default=None, metavar="DIR", help="where eval.json/eval.md/eval.png go")
    ap.add_argument("--force", action="store_true", help="overwrite earlier results and the card section")
    ap.add_argument("--max-doc-chars", type=int, default=MAX_DOC_CHARS, help="document size for text scoring")
    ap.add_argument("--stride", type=int, default=None, help="window stride for long documents (default n_ctx/2)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")


def check_common_args(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be >= 1, got {args.limit}")
    if args.max_doc_chars < 1:
        raise EvalError(f"--max-doc-chars must be >= 1, got {args.max_doc_chars}")


def run_dir_of(ckpt_path: Path, given: Path) -> Path | None:
    """The run folder of a checkpoint: the folder given, or RUN for RUN/checkpoints/step_N."""
    if given.resolve() != ckpt_path.resolve():
        return given
    return ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else None


def run_cli(args: argparse.Namespace) -> int:
    from training.checkpoint import load_model

    check_common_args(args)
    if args.margin < 0:
        raise EvalError(f"--margin must be >= 0, got {args.margin}")
    req = build_request(args.text, args.mc, limit=args.limit, max_doc_chars=args.max_doc_chars, stride=args.stride)
    given = Path(args.path)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, ck = load_model(given, args.step, device=device)
    run_dir = run_dir_of(ck.path, given)
    out_dir = Path(args.out) if args.out else (run_dir / "eval" if run_dir else None)
    if out_dir is None:
        raise EvalError(f"{given} is a checkpoint outside a run folder; pass --out DIR")
    card = run_dir / "export" / "README.md" if run_dir else None
    if (out_dir / OUTPUT_FILES[0]).exists() and not args.force:  # fail before minutes of scoring
        raise EvalError(f"{out_dir / OUTPUT_FILES[0]} already exists; pass --force to overwrite or --out DIR")
    progress = not args.no_progress
    provider = TorchProvider(model, ck.tokenizer, name="model")
    models = [evaluate_model(provider, req, progress=progress)]
    gates: list[GateResult] = []
    if not args.no_twin and req.docs:
        twin = TorchProvider(make_twin(ck.config, args.twin_seed, device), ck.tokenizer, name="twin")
        models.append(evaluate_model(twin, req, mc=args.twin_mc, progress=progress))
        m, t = models[0]["lm"][ALL], models[1]["lm"][ALL]
        gates.append(twin_result(m["nll_per_token"], t["nll_per_token"], m["tokens"], margin=args.margin,
                                 seed=args.twin_seed, what="text"))
    report = make_report("checkpoint", str(ck.path), models, req, gates=gates,
                         reference="model" if len(models) > 1 else None,
                         extra={"step": ck.state.get("step"), "twin_seed": args.twin_seed})
    written = write_outputs(report, out_dir, force=args.force)
    if card is not None and card.is_file():
        update_card(card, render_markdown(report), force=args.force)
        written.append(card)
    print(render_markdown(report))
    print("wrote " + ", ".join(str(p) for p in written))
    if args.fail_on_gate and any(not g.passed for g in gates):
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.evaluate", description=(
        "Evaluate a trained checkpoint: NLL/token, bits per byte and per character by language, beside the "
        "random-init twin, and multiple-choice accuracy."))
    ap.add_argument("path", help="a run folder (its newest checkpoint) or a checkpoint folder")
    ap.add_argument("--step", type=int, default=None, help="a specific checkpoint step of the run")
    add_common_args(ap)
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--no-twin", action="store_true", help="skip the random-init twin")
    ap.add_argument("--twin-mc", action="store_true", help="also score multiple choice with the twin")
    ap.add_argument("--twin-seed", type=int, default=TWIN_SEED)
    ap.add_argument("--margin", type=float, default=TWIN_MARGIN, help="twin gate margin, nats/token")
    ap.add_argument("--fail-on-gate", action="store_true", help="exit 1 when the twin gate fails")
    args = ap.parse_args(argv)
    return guarded(lambda: run_cli(args), debug=args.debug)  # EvalError, CheckpointError, ... are ValueErrors


if __name__ == "__main__":
    sys.exit(main())

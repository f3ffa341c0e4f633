"""Language modelling by language: NLL per token, bits per byte and per character of the normalized text.

    bits/byte = sum over scored tokens of -ln p(token | prefix)  /  ln 2  /  UTF-8 bytes of the text

Every document is scored as <s> + tokens, and every token after <s> is counted (the first one too),
so the scored tokens cover all bytes. Documents longer than the context are scored in overlapping
windows (stride), each token once, with at least n_ctx - stride tokens of context.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.evaluate.providers import EvalError, LogProbProvider
from training.runfiles.json_records import read_records
from training.runfiles.progress import bar as progress_bar
from training.text.normalization import detect_language, normalize, read_utf8, script_counts

LN2 = math.log(2.0)
MAX_DOC_CHARS = 4096  # consecutive same-language lines are grouped into documents up to this size
ALL = "all"  # the key of the all-languages total
RECORD_SUFFIXES = (".json", ".jsonl")  # --text files read as records with a "text" field


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
    with progress_bar(total=len(spans), desc=desc, unit="seq", enabled=progress) as bar:
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
        per_doc.append(LMStats(docs=1, tokens=len(ids) - 1, bytes=len(doc.encode("utf-8")), chars=len(doc)))
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


def file_texts(path: str | Path) -> Iterator[str]:
    """The texts of one --text file: the whole file, or for .json/.jsonl each record's "text" (or the
    record itself when it is a string); record boundaries are document boundaries."""
    p = Path(path)
    if p.suffix not in RECORD_SUFFIXES:
        yield read_utf8(p, "text file", EvalError)
        return
    for rec in read_records(p, "text file", EvalError):
        text = rec.value.get("text") if isinstance(rec.value, dict) else rec.value
        if not isinstance(text, str):
            raise rec.error('expected a string or an object with a string "text"', EvalError)
        yield text


def read_text_docs(paths: Sequence[str | Path], max_chars: int = MAX_DOC_CHARS,
                   limit_chars: int | None = None) -> list[tuple[str, str]]:
    """(language, document) pieces of every file; at most `limit_chars` characters are read per file."""
    docs: list[tuple[str, str]] = []
    for p in paths:
        budget = limit_chars
        for text in file_texts(p):
            if budget is not None:
                text, budget = text[:budget], budget - min(budget, len(text))
            docs.extend(split_documents(text, max_chars))
            if budget == 0:
                break
    if not docs:
        raise EvalError(f"no text to score in {', '.join(map(str, paths))}")
    return docs

"""Multiple choice: each choice gets the log-likelihood of its continuation given <s> + its context,
ranked three ways (sum, per character, per UTF-8 byte), with a 95% Wilson interval and the exact
chance rate (the mean of 1/choices). Formats read:

    llm-foundry JSONL   {"query", "choices", "gold"}                   " " + choice after the query
    Winogrande          {"context_options", "continuation", "gold"}    the shared continuation after each context
    HellaSwag           {"ctx", "endings", "label"}                    cleaned as lm-evaluation-harness does
    Okapi m_ARC (list)  {"instruction", "option_a".., "answer": "A"..} each option after "Question: ...\\nAnswer:"
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from training.evaluate.providers import EvalError, LogProbProvider
from training.evaluate.text_scores import Span, score_spans
from training.runfiles.file_ops import expand_files
from training.runfiles.json_records import read_records
from training.text.normalization import normalize

WILSON_Z = 1.959963984540054  # two-sided 95% normal quantile
MC_EXTENSIONS = (".json", ".jsonl")
OKAPI_LETTERS = "abcdefgh"
SCORE_KINDS = {"acc": "sum log-likelihood", "acc_norm_char": "log-likelihood per character",
               "acc_norm_byte": "log-likelihood per UTF-8 byte"}


@dataclass
class MCItem:
    """contexts[j] + continuations[j] is choice j; only the continuation is scored."""

    contexts: list[str]
    continuations: list[str]
    gold: int

    @property
    def n_choices(self) -> int:
        return len(self.continuations)


def join_choice(context: str, choice: str) -> str:
    """The continuation as scored: a space separates it from the context unless whitespace already does."""
    return choice if (not context or context[-1].isspace() or choice[:1].isspace()) else " " + choice


def _hellaswag_clean(text: str) -> str:
    # As lm-evaluation-harness preprocesses HellaSwag (WikiHow artifacts).
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _item(context: str | list[str], choices: list[str], gold: int) -> MCItem:
    contexts = context if isinstance(context, list) else [context] * len(choices)
    return MCItem(contexts, [join_choice(c, ch) for c, ch in zip(contexts, choices)], gold)


def _strings(rec: dict, key: str) -> list[str]:
    """rec[key] as a list of strings (the choices): a string, an object or a number is no list of choices."""
    v = rec[key]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise EvalError(f"{key!r} must be a list of strings, got {type(v).__name__} {_shown(v)}")
    return v


def _string(rec: dict, key: str) -> str:
    if not isinstance(rec[key], str):
        raise EvalError(f"{key!r} must be a string, got {type(rec[key]).__name__} {_shown(rec[key])}")
    return rec[key]


def _gold(rec: dict, key: str) -> int:
    """The gold index: a JSON integer (true/false and 1.0 are no index), or a string of digits, as
    Hugging Face's copy of HellaSwag stores its label."""
    v = rec[key]
    if isinstance(v, str) and v.isascii() and v.isdigit():
        return int(v)
    if type(v) is not int:
        raise EvalError(f"{key!r} must be an integer index, got {type(v).__name__} {_shown(v)}")
    return v


def _shown(v: object) -> str:
    return json.dumps(v, ensure_ascii=False)[:40]


def parse_mc_record(rec: dict) -> tuple[str, MCItem]:
    """(format name, item) for one record of a supported format, its fields checked against the
    format (choices a list of strings, gold an integer); EvalError naming the field otherwise."""
    if not isinstance(rec, dict):
        raise EvalError(f"expected a JSON object, got {type(rec).__name__}")
    if {"query", "choices", "gold"} <= rec.keys():
        return "llm-foundry", _item(_string(rec, "query"), _strings(rec, "choices"), _gold(rec, "gold"))
    if {"context_options", "continuation", "gold"} <= rec.keys():  # Winogrande: shared continuation
        ctxs = _strings(rec, "context_options")
        return "winogrande", _item(ctxs, [_string(rec, "continuation")] * len(ctxs), _gold(rec, "gold"))
    if {"ctx", "endings", "label"} <= rec.keys():
        return "hellaswag", _item(_hellaswag_clean(_string(rec, "ctx")),
                                  [_hellaswag_clean(e) for e in _strings(rec, "endings")], _gold(rec, "label"))
    if {"instruction", "option_a", "answer"} <= rec.keys():  # Okapi m_ARC, lm-evaluation-harness's prompt
        keys = [f"option_{c}" for c in OKAPI_LETTERS if rec.get(f"option_{c}")]
        opts = [_string(rec, k) for k in keys]
        answer = _string(rec, "answer")
        letter = answer.strip().lower()
        if len(letter) != 1 or letter not in OKAPI_LETTERS[: len(opts)]:
            raise EvalError(f"answer must be a letter A-{OKAPI_LETTERS[len(opts) - 1].upper()}, got {answer!r}")
        return "okapi-arc", _item(f"Question: {_string(rec, 'instruction')}\nAnswer:", opts, OKAPI_LETTERS.index(letter))
    raise EvalError(f"unknown multiple-choice record with keys {sorted(rec)}; expected query/choices/gold, "
                    "context_options/continuation/gold, ctx/endings/label or instruction/option_a../answer")


def _validate(item: MCItem) -> MCItem:
    if item.n_choices < 2:
        raise EvalError(f"needs at least 2 choices, got {item.n_choices}")
    if not 0 <= item.gold < item.n_choices:
        raise EvalError(f"gold index {item.gold} out of range for {item.n_choices} choices")
    return item


def load_mc(path: str | Path, limit: int | None = None) -> tuple[str, list[MCItem]]:
    """Items of a multiple-choice file (JSONL records, or one JSON list) and their format name."""
    formats, items = set(), []
    for rec in islice(read_records(path, "multiple-choice file", EvalError), limit or None):
        try:
            fmt, item = parse_mc_record(rec.value)
            items.append(_validate(item))
        except EvalError as e:
            raise rec.error(str(e), EvalError) from None
        except (TypeError, KeyError, AttributeError) as e:
            raise rec.error(f"malformed record ({e})", EvalError) from None
        formats.add(fmt)
    if not items:
        raise EvalError(f"{path}: no multiple-choice items")
    return "+".join(sorted(formats)), items


def mc_set_name(path: str | Path) -> str:
    """A short name for a file: 'llm-foundry__arc_easy.jsonl' -> 'arc_easy' (the source prefix dropped)."""
    stem = Path(path).name.split(".")[0]
    return stem.split("__", 1)[-1].replace("__", "_")


def expand_mc_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Files as given; folders expand to their *.json / *.jsonl files."""
    return expand_files(paths, EvalError, what="multiple-choice file", suffixes=MC_EXTENSIONS, recursive=False)


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


@dataclass
class MCScores:
    """Per item and choice: summed log-likelihood of the continuation, its chars and bytes."""

    items: list[MCItem]
    loglik: list[list[float]]
    chars: list[list[int]]
    bytes: list[list[int]]
    truncated: int = 0

    def predictions(self, kind: str = "acc") -> list[int]:
        if kind not in SCORE_KINDS:
            raise EvalError(f"unknown score kind {kind!r}")
        per = {"acc": None, "acc_norm_char": self.chars, "acc_norm_byte": self.bytes}[kind]
        if per is None:
            return [int(np.argmax(ll)) for ll in self.loglik]
        return [int(np.argmax([v / max(1, n) for v, n in zip(ll, ns)])) for ll, ns in zip(self.loglik, per)]

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

"""Data and tokenizer pre-flight gates.

    data.token_range         every token id (train shards, validation windows) < vocab_size
    data.no_repeats          the first K windows the loader actually yields are all distinct
    data.train_val_disjoint  no validation window shares a NGRAM-token span with the training tokens
    tokenizer.fertility      } the [tokenizer] gates, recomputed from DATA_DIR/report.json's
    tokenizer.balance        } measurements (or measured on validation text when it has none)

The loader is read through its own `next_batch` (state saved and restored), so a loader bug that
repeats a batch is seen exactly as training would see it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from training.gates.context import PreflightContext
from training.runfiles.gate_results import GateResult
from training.text.fertility import DEFAULT_BALANCE_RANGE, fertility_gates, fertility_report

if TYPE_CHECKING:
    from training.data.loaders import Loader

NO_REPEAT_WINDOWS = 64  # K: windows drawn from the loader for the repeat check
NGRAM = 32  # tokens: a shared span this long is the same text, not a common phrase
NGRAM_SEED = 20240601  # fixed hash coefficients: the gate is deterministic
# Fraction of validation windows allowed to share a span with training. Real corpora repeat some
# boilerplate across documents (Project Gutenberg's license paragraphs: 2 of 512 windows of the shared
# en+bn data); a split bug or a copied file shares nearly all of them.
MAX_VAL_OVERLAP = 0.02
TRAIN_SCAN_TOKENS = 1 << 24  # training tokens scanned for overlap (evenly spaced chunks beyond this)
RANGE_SCAN_TOKENS = 1 << 28  # training tokens scanned for the maximum token id
SCAN_CHUNK = 1 << 20
TOKENIZER_SAMPLE_TOKENS = 1 << 16  # validation tokens decoded to measure fertility without a report
EXAMPLE_CHARS = 80
MAX_SAMPLE_BATCHES = 64  # for loaders without a token stream (SFT): batches drawn as the sample


# ------------------------------------------------------------------------------------ helpers
def draw_batches(loader: Loader, batch_size: int, n_batches: int) -> list[tuple]:
    """The loader's next `n_batches` batches, without consuming them."""
    state = loader.state_dict()
    try:
        return [loader.next_batch(batch_size) for _ in range(n_batches)]
    finally:
        loader.load_state_dict(state)


def _rows(batches: list[tuple]) -> list[np.ndarray]:
    """Each row as the full window it came from: inputs plus the last target token."""
    out = []
    for b in batches:
        x, y = b[0].numpy(), b[1].numpy()
        for i in range(x.shape[0]):
            out.append(np.concatenate([x[i], y[i, -1:]]).astype(np.int64))
    return out


def _coefficients(n: int) -> np.ndarray:
    return np.random.default_rng(NGRAM_SEED).integers(1, 2**63 - 1, size=n, dtype=np.uint64) | np.uint64(1)


def ngram_hashes(tokens: np.ndarray, n: int = NGRAM) -> np.ndarray:
    """A 64-bit hash of every n-token span (sum of token x random odd coefficient, mod 2^64)."""
    t = np.asarray(tokens).astype(np.uint64)
    m = len(t) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    c = _coefficients(n)
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h += t[j: j + m] * c[j]
    return h


def _chunks(n_tokens: int, budget: int, chunk: int, overlap: int) -> list[tuple[int, int]]:
    """(start, length) chunks covering the stream, or evenly spaced ones adding up to `budget`."""
    if n_tokens <= budget:
        return [(s, min(chunk + overlap, n_tokens - s)) for s in range(0, n_tokens, chunk)]
    k = max(1, budget // chunk)
    starts = np.linspace(0, n_tokens - chunk - overlap, k).astype(np.int64)
    return [(int(s), chunk + overlap) for s in starts]


# --------------------------------------------------------------------------------------- gates
def token_range(ctx: PreflightContext, val_rows: list[np.ndarray]) -> GateResult:
    vocab = ctx.model_cfg.vocab_size
    loader = ctx.batches.train
    stream = getattr(loader, "stream", None)
    hi, where, scanned, total = -1, "", 0, 0
    if stream is not None:
        total = stream.n_tokens
        per_part = max(SCAN_CHUNK, RANGE_SCAN_TOKENS // max(1, len(stream.parts)))
        for path, part in zip(stream.paths, stream.parts):
            for s, n in _chunks(len(part), per_part, SCAN_CHUNK, 0):
                if n <= 0:
                    continue
                m = int(np.max(part[s: s + n]))
                scanned += n
                if m > hi:
                    hi, where = m, path.name
    else:
        for r in _rows(draw_batches(loader, ctx.cfg.batch_size, MAX_SAMPLE_BATCHES)):
            scanned += len(r)
            if int(r.max()) > hi:
                hi, where = int(r.max()), "training batches"
    for r in val_rows:
        if len(r) and int(r.max()) > hi:
            hi, where = int(r.max()), "validation windows"
    cover = f"{scanned:,} of {total:,} training tokens" if total else f"{scanned:,} sampled training tokens"
    detail = f"max token id {hi} (in {where}), vocabulary {vocab}; scanned {cover} + {len(val_rows)} validation windows"
    if hi >= vocab:
        detail = f"token id {hi} is outside the vocabulary (data tokenized with another tokenizer?); " + detail
    return GateResult("data.token_range", hi < vocab, value=float(hi), threshold=f"< {vocab}", detail=detail)


def no_repeats(ctx: PreflightContext, k: int = NO_REPEAT_WINDOWS) -> GateResult:
    bs = ctx.cfg.batch_size
    rows = _rows(draw_batches(ctx.batches.train, bs, max(1, -(-k // bs))))[:k]
    digests = [hashlib.sha1(r.tobytes()).hexdigest() for r in rows]
    seen: dict[str, int] = {}
    repeats = []
    for i, d in enumerate(digests):
        if d in seen:
            repeats.append((seen[d], i))
        else:
            seen[d] = i
    detail = f"{len(repeats)} repeats among the first {len(rows)} training windows the loader yields"
    if repeats:
        shown = ", ".join(f"#{j} = #{i}" for i, j in repeats[:5])
        detail = f"the loader repeats windows ({shown}); " + detail
    return GateResult("data.no_repeats", not repeats, value=float(len(repeats)), threshold="0 repeated windows",
                      detail=detail)


def train_val_disjoint(ctx: PreflightContext, val_rows: list[np.ndarray], n: int = NGRAM,
                       max_overlap: float = MAX_VAL_OVERLAP) -> GateResult:
    name = "data.train_val_disjoint"
    if not val_rows:
        return GateResult(name, True, value=0.0, threshold=f"<= {max_overlap:.0%}",
                          detail="no validation split: nothing to compare")
    per_row = [ngram_hashes(r, n) for r in val_rows]
    val_all = np.unique(np.concatenate(per_row)) if per_row else np.empty(0, np.uint64)
    hits: list[np.ndarray] = []
    loader = ctx.batches.train
    stream = getattr(loader, "stream", None)
    if stream is not None:
        chunks = _chunks(stream.n_tokens, TRAIN_SCAN_TOKENS, SCAN_CHUNK, n - 1)
        scanned = 0
        for s, length in chunks:
            length = min(length, stream.n_tokens - s)
            if length < n:
                continue
            h = ngram_hashes(stream.slice(s, length), n)
            hits.append(h[np.isin(h, val_all)])
            scanned += length - (n - 1)
        cover = (f"all {stream.n_tokens:,} training tokens" if stream.n_tokens <= TRAIN_SCAN_TOKENS
                 else f"{scanned:,} of {stream.n_tokens:,} training tokens, evenly spaced")
    else:
        sample = _rows(draw_batches(loader, ctx.cfg.batch_size, MAX_SAMPLE_BATCHES))
        for r in sample:
            h = ngram_hashes(r, n)
            hits.append(h[np.isin(h, val_all)])
        cover = f"{len(sample)} sampled training windows"
    shared = np.unique(np.concatenate(hits)) if hits else np.empty(0, np.uint64)
    overlapping = [i for i, h in enumerate(per_row) if len(h) and np.isin(h, shared).any()]
    frac = len(overlapping) / len(val_rows)
    detail = (f"{len(overlapping)} of {len(val_rows)} validation windows share a {n}-token span with training "
              f"(scanned {cover})")
    if overlapping:
        detail += f"; e.g. {_example_span(ctx, val_rows[overlapping[0]], per_row[overlapping[0]], shared, n)!r}"
    if frac > max_overlap:
        detail = "validation text also appears in training (validation loss would be optimistic); " + detail
    return GateResult(name, frac <= max_overlap, value=frac, threshold=f"<= {max_overlap:.0%} of validation windows",
                      detail=detail)


def _example_span(ctx: PreflightContext, row: np.ndarray, hashes: np.ndarray, shared: np.ndarray, n: int) -> str:
    """The first shared span as text, so a person can tell boilerplate from a leaked split."""
    i = int(np.argmax(np.isin(hashes, shared)))
    ids = row[i: i + n].tolist()
    text = ctx.batches.tokenizer.decode(ids)
    return text[:EXAMPLE_CHARS] + ("…" if len(text) > EXAMPLE_CHARS else "")


def _val_rows(ctx: PreflightContext) -> list[np.ndarray]:
    val = ctx.batches.val
    return _rows(val(ctx.cfg.eval_batches)) if val is not None else []


def data_gates(ctx: PreflightContext, k: int = NO_REPEAT_WINDOWS) -> list[GateResult]:
    own = getattr(ctx.batches.train, "data_gates", None)
    if own is not None:  # padded SFT conversations (training.sft) check themselves: padding is no overlap
        return own(ctx)
    vrows = _val_rows(ctx)
    return [token_range(ctx, vrows), no_repeats(ctx, k), train_val_disjoint(ctx, vrows)]


# ---------------------------------------------------------------------------------- tokenizer
def _decoded_docs(ctx: PreflightContext, budget: int = TOKENIZER_SAMPLE_TOKENS) -> list[str]:
    """Validation (else training) windows decoded back to text, cut at <s>/</s>: documents to measure."""
    tok = ctx.batches.tokenizer
    rows = _val_rows(ctx) or _rows(draw_batches(ctx.batches.train, ctx.cfg.batch_size, MAX_SAMPLE_BATCHES))
    docs, used = [], 0
    bounds = {tok.bos_id, tok.eos_id, tok.pad_id}
    for r in rows:
        if used >= budget:
            break
        used += len(r)
        cur: list[int] = []
        for t in r.tolist() + [tok.eos_id]:
            if t in bounds:
                if cur:
                    docs.append(tok.decode(cur))
                cur = []
            else:
                cur.append(t)
    return docs


def tokenizer_gates(ctx: PreflightContext) -> list[GateResult]:
    """The fertility and balance gates, recomputed (never just copied) from the data's measurements."""
    tok = ctx.batches.tokenizer
    rep = ctx.batches.data_report or {}
    fert = rep.get("fertility")
    opts = rep.get("gate_options", {})
    if not isinstance(opts, dict):
        opts = {}  # a damaged report: the defaults (training.data.loaders refuses reports whose sections are not objects)
    kwargs = {}
    if "fertility_floor" in opts:
        kwargs["floor"] = opts["fertility_floor"]
    if "fertility_ratio" in opts:
        kwargs["ratio"] = opts["fertility_ratio"]
    kwargs["balance_range"] = tuple(opts.get("balance_range", DEFAULT_BALANCE_RANGE))
    results, why = None, "no fertility report"
    if isinstance(fert, dict) and fert.get("tokenizer_sha256") in (None, tok.sha256):
        try:
            results = fertility_gates(fert, **kwargs)
            source = f"data report ({fert.get('total', {}).get('n_docs', '?')} held-out documents)"
        except (KeyError, TypeError, ValueError, AttributeError):
            results, why = None, "a malformed fertility section"
    elif fert:
        why = "the report describes another tokenizer"
    if results is None:  # measured here instead
        docs = _decoded_docs(ctx)
        if not docs:
            return [GateResult("tokenizer", True, detail=f"{why} and no text to measure: nothing to gate")]
        fert = fertility_report(tok, docs)
        source = f"measured on {len(docs)} decoded validation documents ({why} in the data folder)"
        results = fertility_gates(fert, **kwargs)
    skipped_at_prepare = set(opts.get("skip_gates", []))
    for r in results:
        r.detail = f"{r.detail} [{source}]"
        if r.name in skipped_at_prepare and not r.passed:
            r.detail = (f"failed at prepare time too, where it was skipped with --skip-gate; skip it here as well "
                        f"to train anyway: {r.detail}")
    return results

"""Pass 1, clean: normalize, quality rules, decontamination, shard ownership (workers), then exact
and near-duplicate removal (main process, in input order). Its result is one byte per raw document
(`keep`), read by the later passes, plus every count the report shows.

A document's fate is decided once, here: `dropped` counts it under one reason, in this order:
empty, a quality rule, contaminated, exact duplicate, near duplicate (documents that belong to
another --shard-index are skipped, not dropped). Dedup runs
before the split is decided, so a document and its near-copy can never land in train and val.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from training.prepare.cluster.pool import chunks, ordered_map, resolve_workers
from training.prepare.cluster.worker_memory import MemoryPlan
from training.prepare.decontam import EvalIndex
from training.prepare.dedup import DedupIndex, band_keys, exact_key, word_hashes
from training.prepare.errors import PrepareError, Unreadable
from training.prepare.keys import SALT_EVAL, hash_key, shard_of, split_of
from training.prepare.options import Options
from training.prepare.quality import PrepConfig, QualityRules
from training.prepare.sources import FileSource, HFSource, clean
from training.runfiles.progress import bar as progress_bar
from training.text.normalization import LANGUAGES, language_of_counts, match_words, script_counts

EXAMPLES_PER_REASON = 3
SNIPPET_CHARS = 300
MAX_CONTAMINATED_RECORDED = 10_000
OK = "ok"


class HeldOutSample:
    """The held-out documents with the smallest keyed hash, at most `max_docs` of them and
    `max_chars` characters together: bounded memory at any corpus size, and the same documents
    for any input order (always the longest hash-ordered prefix that fits)."""

    def __init__(self, max_docs: int, max_chars: int):
        self.max_docs, self.max_chars = max_docs, max_chars
        self.heap: list[tuple[int, str]] = []  # (-key, doc): heap[0] holds the largest key
        self.chars = 0
        self.bound: int | None = None  # the smallest key ever evicted: larger ones can never fit

    def offer(self, key: int, doc: str) -> None:
        if self.bound is not None and key >= self.bound:
            return
        heapq.heappush(self.heap, (-key, doc))
        self.chars += len(doc)
        while len(self.heap) > self.max_docs or self.chars > self.max_chars:
            neg, out = heapq.heappop(self.heap)
            self.chars -= len(out)
            self.bound = -neg if self.bound is None else min(self.bound, -neg)

    def docs(self) -> list[str]:
        """In key order."""
        return [d for _, d in sorted(self.heap, reverse=True)]


@dataclass
class CleanResult:
    sources: list  # the readable sources, in order (later passes read exactly these)
    skipped: list[dict]
    keep: bytearray = field(default_factory=bytearray)  # one byte per raw document: 1 kept
    n_raw: int = 0  # raw documents read, including other shards' (the keep index runs over all)
    n_other_shards: int = 0  # read but owned by another --shard-index: not this run's, not "dropped"
    kept: dict[str, dict] = field(default_factory=lambda: {s: {"n_docs": 0, "n_chars": 0, "n_bytes": 0}
                                                           for s in ("train", "val")})
    lang_chars: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LANGUAGES, 0))
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_chars: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    contaminated: list[dict] = field(default_factory=list)
    eval_sample: HeldOutSample = field(default_factory=lambda: HeldOutSample(1, 0))
    dedup: dict = field(default_factory=dict)

    def drop(self, reason: str, snippet: str, n_chars: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.dropped_chars[reason] = self.dropped_chars.get(reason, 0) + n_chars
        ex = self.examples.setdefault(reason, [])
        if len(ex) < EXAMPLES_PER_REASON and snippet:
            ex.append(snippet)


def raw_texts(sources: Sequence, text_field: str) -> Iterator[str]:
    for s in sources:
        yield from s.texts(text_field)


def validate_files(sources: list, opt: Options) -> tuple[list, list[dict], int]:
    """Read every file once, raw (cheap): unreadable ones are skipped (fatal with --strict)."""
    ok, skipped, n_bytes = [], [], 0
    files = [s for s in sources if isinstance(s, FileSource)]
    bar = progress_bar(files, desc="check files", unit="file", enabled=opt.progress and bool(files))
    for s in sources:
        if isinstance(s, HFSource):
            ok.append(s)
            continue
        try:
            n_bytes += sum(len(t.encode("utf-8")) for t in s.texts(opt.text_field))
        except Unreadable as e:
            if opt.strict:
                raise PrepareError(f"unreadable input {s.path}: {e} (--strict)") from None
            skipped.append({"path": str(s.path), "reason": str(e)})
            continue
        finally:
            bar.update()
        ok.append(s)
    bar.close()
    if skipped:
        print(f"warning: skipped {len(skipped)} unreadable file(s), e.g. {skipped[0]['path']}: "
              f"{skipped[0]['reason']}", file=sys.stderr)
    return ok, skipped, n_bytes


# ---------------------------------------------------------------- worker side

_w: dict = {}


def init_worker(rules: QualityRules | None, eval_index: EvalIndex | None, dedup: dict | None, opt: dict) -> None:
    _w.update(rules=rules, eval_index=eval_index, dedup=dedup, opt=opt)


def _judge(text: str) -> tuple:
    """(status, exact key, band keys or None, lang, chars, bytes, split, text or snippet)."""
    doc = clean(text)
    if doc is None:
        return ("empty", 0, None, "", 0, 0, "", "")
    o = _w["opt"]
    exact = exact_key(doc, o["seed"])
    n_chars, n_bytes = len(doc), len(doc.encode("utf-8"))
    if o["num_shards"] > 1 and shard_of(exact, o["num_shards"]) != o["shard_index"]:
        return ("other_shard", 0, None, "", n_chars, n_bytes, "", "")
    words = match_words(doc)
    counts = script_counts(doc)
    snippet = doc[:SNIPPET_CHARS]
    rules, eval_index, dedup = _w["rules"], _w["eval_index"], _w["dedup"]
    if rules is not None and (rule := rules.check(doc, words, counts)) is not None:
        return (rule, 0, None, "", n_chars, n_bytes, "", snippet)
    w = word_hashes(words)
    if eval_index is not None and (owner := eval_index.match(w)) is not None:
        return (f"contaminated:{owner}", 0, None, "", n_chars, n_bytes, "", snippet)
    bands = None
    if dedup is not None and dedup.get("near"):
        bands = band_keys(w, shingle_words=dedup["shingle_words"], num_perm=dedup["num_perm"],
                          bands=dedup["bands"], seed=o["seed"]).tobytes()
    split = split_of(doc, o["val_fraction"], o["seed"])
    return (OK, exact, bands, language_of_counts(counts), n_chars, n_bytes, split,
            doc if split == "val" else snippet)


def judge_chunk(texts: list[str]) -> tuple[list[tuple], int]:
    return [_judge(t) for t in texts], sum(len(t.encode("utf-8")) for t in texts)


# ---------------------------------------------------------------- main side


def clean_pass(sources: list, skipped: list[dict], opt: Options, cfg: PrepConfig, eval_index: EvalIndex | None,
               total_bytes: int, plan: MemoryPlan) -> CleanResult:
    res = CleanResult(sources=sources, skipped=skipped,
                      eval_sample=HeldOutSample(opt.eval_docs, plan.eval_sample_chars))
    dedup_cfg = {**cfg.dedup, "near": opt.near_dedup} if opt.dedup else None
    index = DedupIndex(plan.index_mb, near=opt.near_dedup, bands=cfg.dedup["bands"]) if opt.dedup else None
    wopt = {"seed": opt.seed, "val_fraction": opt.val_fraction, "num_shards": opt.num_shards,
            "shard_index": opt.shard_index}
    bar = progress_bar(total=total_bytes or None, desc="clean", unit="B", unit_scale=True, unit_divisor=1000,
                       enabled=opt.progress, smoothing=0.1, leave=True)
    tasks = ((c,) for c in chunks(raw_texts(sources, opt.text_field)))
    for verdicts, seen in ordered_map(judge_chunk, tasks, resolve_workers(opt.workers), init_worker,
                                      (cfg.quality if opt.filters else None, eval_index, dedup_cfg, wopt)):
        dups = _dedup(verdicts, index)
        for v, dup in zip(verdicts, dups):
            _account(res, v, dup, opt, eval_index)
        bar.update(seen)
    bar.close()
    res.dedup = index.stats() if index is not None else {}
    if index is not None and (line := index.full_warning(sum(st["n_docs"] for st in res.kept.values()))):
        print(line, file=sys.stderr)
        res.dedup["index_full_warning"] = line.removeprefix("warning: ")
    return res


def _dedup(verdicts: list[tuple], index: DedupIndex | None) -> list[str | None]:
    """The duplicate verdict of each document that passed the other checks (None: not a duplicate)."""
    out: list[str | None] = [None] * len(verdicts)
    ok = [i for i, v in enumerate(verdicts) if v[0] == OK]
    if index is None or not ok:
        return out
    exact = np.array([verdicts[i][1] for i in ok], dtype=np.uint64)
    bands = (np.frombuffer(b"".join(verdicts[i][2] for i in ok), dtype=np.uint64).reshape(len(ok), -1)
             if verdicts[ok[0]][2] else None)
    for i, dup in zip(ok, index.check_chunk(exact, bands)):
        out[i] = dup
    return out


def _account(res: CleanResult, v: tuple, dup: str | None, opt: Options, eval_index: EvalIndex | None) -> None:
    status, exact, bands, lang, n_chars, n_bytes, split, text = v
    i = res.n_raw
    res.n_raw += 1
    status = dup or status
    if status == "other_shard":
        res.keep.append(0)
        res.n_other_shards += 1
        return
    if status != OK:
        res.keep.append(0)
        if status.startswith("contaminated:"):
            owner = int(status.split(":")[1])
            assert eval_index is not None
            eval_index.sets[owner]["documents_removed"] += 1
            if len(res.contaminated) < MAX_CONTAMINATED_RECORDED:
                res.contaminated.append({"doc_index": i, "eval_set": eval_index.sets[owner]["path"],
                                         "snippet": text[:SNIPPET_CHARS]})
            status = "contaminated"
        res.drop(status, text[:SNIPPET_CHARS], n_chars)
        return
    res.keep.append(1)
    st = res.kept[split]
    st["n_docs"] += 1
    st["n_chars"] += n_chars
    st["n_bytes"] += n_bytes
    res.lang_chars[lang] += n_chars
    if split == "val":
        res.eval_sample.offer(hash_key(text, SALT_EVAL, opt.seed), text)

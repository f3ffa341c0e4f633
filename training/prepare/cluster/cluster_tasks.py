"""The stages of `--executor ... --tasks N` before the merge (training.prepare.cluster.cluster_merge):

    scan    N tasks   each task's files through the clean pass's judge (normalize, quality rules,
                      decontamination, exact key, MinHash band keys): one verdict per document
    dedup   1 task    the one-machine dedup decision over all tasks' keys, in input order, with the
                      same index, chunks and cap (training.prepare.dedup.DedupIndex): a near-duplicate
                      pair split across tasks is caught exactly as on one machine
    encode  N tasks   each task's kept documents into token shards (training.prepare.encode), plus
                      its held-out sample and duplicate examples for the report

Each task writes WORK/STAGE/RANK/ (arrays as safetensors, the rest as task.json, written last);
datatrove's completion marker (WORK/logs/STAGE/completions/RANK) says it finished.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from training.prepare.clean import (
    EXAMPLES_PER_REASON,
    MAX_CONTAMINATED_RECORDED,
    OK,
    SNIPPET_CHARS,
    CleanResult,
    HeldOutSample,
    init_worker,
    judge_chunk,
    raw_texts,
    validate_files,
)
from training.prepare.cluster.cluster_plan import (
    Clock,
    check_finished,
    fresh,
    options_from,
    read_plan,
    task_dir,
    write_task,
)
from training.prepare.cluster.pool import CHUNK_CHARS, chunks, ordered_map, resolve_workers
from training.prepare.cluster.worker_memory import EVAL_SAMPLE_CHARS, plan_memory
from training.prepare.decontam import EvalIndex, resolve_eval_paths
from training.prepare.dedup import DedupIndex
from training.prepare.encode import encode_pass
from training.prepare.errors import PrepareError
from training.prepare.keys import SALT_EVAL, hash_key
from training.prepare.options import mix_keep_probabilities
from training.prepare.quality import load_config
from training.prepare.sources import clean, resolve_sources
from training.text.normalization import LANGUAGES
from training.text.tokenizer import Tokenizer

DUPS = ("exact_duplicate", "near_duplicate")  # dup codes 1, 2 in the dedup stage's arrays
NO_LANG = 255


def _sources(names: list[str]) -> list:
    return resolve_sources(names) if names else []


def load_task(work: Path, stage: str, rank: int) -> tuple[dict, dict[str, np.ndarray]]:
    folder = task_dir(work, stage, rank)
    head = json.loads((folder / "task.json").read_text(encoding="utf-8"))
    arrays = load_file(folder / "arrays.safetensors") if (folder / "arrays.safetensors").is_file() else {}
    return head, arrays


# ---------------------------------------------------------------- scan


class _Verdicts:
    """The clean pass's verdicts of one task, in arrays, plus what the report shows of its drops."""

    def __init__(self, sets: list[dict] | None):
        self.codes: dict[str, int] = {}
        self.cols: dict[str, list] = {k: [] for k in ("status", "exact", "lang", "chars", "bytes", "split", "rawlen")}
        self.bands: list[bytes] = []
        self.first: dict[str, int] = {}
        self.examples: dict[str, list] = {}
        self.contaminated: list[dict] = []
        self.removed = [0] * len(sets or [])
        self.sets = sets

    def add(self, v: tuple, rawlen: int) -> None:
        status, exact, bands, lang, n_chars, n_bytes, split, text = v
        i = len(self.cols["status"])
        c = self.cols
        c["status"].append(self.codes.setdefault(status, len(self.codes)))
        c["exact"].append(exact if status == OK else 0)
        c["lang"].append(LANGUAGES.index(lang) if status == OK else NO_LANG)
        c["chars"].append(n_chars)
        c["bytes"].append(n_bytes)
        c["split"].append(1 if split == "val" else 0)
        c["rawlen"].append(rawlen)
        if status == OK:
            self.bands.append(bands or b"")
            return
        reason = status
        if status.startswith("contaminated:"):
            reason, owner = "contaminated", int(status.split(":")[1])
            self.removed[owner] += 1
            if len(self.contaminated) < MAX_CONTAMINATED_RECORDED:
                self.contaminated.append({"doc_index": i, "eval_set": self.sets[owner]["path"],
                                          "snippet": text[:SNIPPET_CHARS]})
        self.first.setdefault(reason, i)
        ex = self.examples.setdefault(reason, [])
        if len(ex) < EXAMPLES_PER_REASON and text:
            ex.append([i, text[:SNIPPET_CHARS]])

    def arrays(self, n_bands: int) -> dict[str, np.ndarray]:
        c = self.cols
        out = {"status": np.asarray(c["status"], dtype=np.uint16), "exact": np.asarray(c["exact"], dtype=np.uint64),
               "lang": np.asarray(c["lang"], dtype=np.uint8), "split": np.asarray(c["split"], dtype=np.uint8)}
        for k in ("chars", "bytes", "rawlen"):
            out[k] = np.asarray(c[k], dtype=np.uint64)
        out["bands"] = np.frombuffer(b"".join(self.bands), dtype=np.uint64).reshape(len(self.bands), -1) \
            if n_bands and self.bands else np.zeros((len(self.bands), 0), dtype=np.uint64)
        return out


def scan(work: Path, rank: int, workers: int = 1) -> None:
    clock = Clock()
    plan = read_plan(work)
    opt = options_from(plan, workers)
    cfg = load_config(opt.quality)
    eval_paths = resolve_eval_paths(opt.decontaminate, shipped=opt.shipped_eval_sets)
    eval_index = (EvalIndex.build(eval_paths, cfg.decontam["ngram_words"], cfg.decontam["min_words"])
                  if eval_paths else None)
    sources, skipped, _ = validate_files(_sources(plan["sources"][rank]), opt)
    dedup_cfg = {**cfg.dedup, "near": opt.near_dedup} if opt.dedup else None
    wopt = {"seed": opt.seed, "val_fraction": opt.val_fraction, "num_shards": 1, "shard_index": 0}
    sets = eval_index.sets if eval_index is not None else None
    rec, lens = _Verdicts(sets), []

    def texts():
        for t in raw_texts(sources, opt.text_field):
            lens.append(len(t))  # the raw length decides where pool.chunks cuts: the dedup stage replays it
            yield t

    n = 0
    for verdicts, _ in ordered_map(judge_chunk, ((c,) for c in chunks(texts())), resolve_workers(opt.workers),
                                   init_worker, (cfg.quality if opt.filters else None, eval_index, dedup_cfg, wopt)):
        for v in verdicts:
            rec.add(v, lens[n])
            n += 1
    folder = fresh(task_dir(work, "scan", rank))
    save_file(rec.arrays(cfg.dedup["bands"] if opt.dedup and opt.near_dedup else 0), folder / "arrays.safetensors")
    write_task(folder, plan, {"stage": "scan", "rank": rank, "n_raw": n, "readable": [s.name for s in sources],
                              "skipped": skipped, "statuses": list(rec.codes), "first": rec.first,
                              "examples": rec.examples, "contaminated": rec.contaminated,
                              "removed_per_set": rec.removed, "eval_sets": sets}, clock)


# ---------------------------------------------------------------- dedup


def chunk_ends(lengths: np.ndarray, acc: int) -> tuple[list[int], int]:
    """Where pool.chunks closes a chunk inside `lengths` (exclusive ends), given `acc` characters
    already in the open chunk; and the open chunk's characters after the last document."""
    cum = np.cumsum(lengths.astype(np.int64))
    ends, base = [], -acc  # the open chunk holds cum[j] - base characters after document j
    while True:
        j = int(np.searchsorted(cum, base + CHUNK_CHARS, side="left"))
        if j >= cum.size:
            return ends, (int(cum[-1]) - base) if cum.size else acc
        ends.append(j + 1)
        base = int(cum[j])


class _Replay:
    """The one-machine dedup decision replayed over the tasks in order: same chunks, same index."""

    def __init__(self, index: DedupIndex | None):
        self.index = index
        self.carry: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (dup array, docs, exact, bands)
        self.acc = 0

    def task(self, arrays: dict[str, np.ndarray], ok: np.ndarray, dup: np.ndarray) -> None:
        ends, acc_after = chunk_ends(arrays["rawlen"], self.acc)
        ok_docs = np.flatnonzero(ok)
        start = 0
        for end in [*ends, None]:
            lo = int(np.searchsorted(ok_docs, start))
            hi = ok_docs.size if end is None else int(np.searchsorted(ok_docs, end))
            self.carry.append((dup, ok_docs[lo:hi], arrays["exact"][ok_docs[lo:hi]], arrays["bands"][lo:hi]))
            if end is None:
                break
            self.close()
            start = end
        self.acc = acc_after

    def close(self) -> None:
        parts, self.carry = [p for p in self.carry if p[1].size], []
        if self.index is None or not parts:
            return
        exact = np.concatenate([p[2] for p in parts])
        bands = np.concatenate([p[3] for p in parts])
        verdicts = self.index.check_chunk(exact, bands if bands.shape[1] else None)
        k = 0
        for dup, docs, _, _ in parts:
            for d, v in zip(docs.tolist(), verdicts[k:k + docs.size]):
                if v is not None:
                    dup[d] = DUPS.index(v) + 1
            k += docs.size


def _ok(head: dict, a: dict[str, np.ndarray]) -> np.ndarray:
    return a["status"] == (head["statuses"].index(OK) if OK in head["statuses"] else -1)


class _Counts:
    """What the report counts, summed over the tasks in order: kept documents per split, characters
    per language, and every drop as [reason, documents, characters, first global index]."""

    def __init__(self):
        self.kept = {s: {"n_docs": 0, "n_chars": 0, "n_bytes": 0} for s in ("train", "val")}
        self.lang_chars = dict.fromkeys(LANGUAGES, 0)
        self.drops: dict[str, list] = {}
        self.offset = 0

    def add(self, head: dict, a: dict[str, np.ndarray], dup: np.ndarray) -> None:
        keep = _ok(head, a) & (dup == 0)
        for s, v in (("train", 0), ("val", 1)):
            m = keep & (a["split"] == v)
            for k, col in (("n_chars", "chars"), ("n_bytes", "bytes")):
                self.kept[s][k] += int(a[col][m].sum())
            self.kept[s]["n_docs"] += int(m.sum())
        for i, lang in enumerate(LANGUAGES):
            self.lang_chars[lang] += int(a["chars"][keep & (a["lang"] == i)].sum())
        groups = [(r if not r.startswith("contaminated:") else "contaminated", a["status"] == c)
                  for c, r in enumerate(head["statuses"]) if r != OK]
        for reason, mask in groups + [(name, dup == k + 1) for k, name in enumerate(DUPS)]:
            if mask.any():
                r = self.drops.setdefault(reason, [reason, 0, 0, self.offset + int(np.argmax(mask))])
                r[1] += int(mask.sum())
                r[2] += int(a["chars"][mask].sum())
        self.offset += head["n_raw"]

    def reasons(self) -> list[list]:
        return sorted(self.drops.values(), key=lambda r: r[3])


def dedup(work: Path, rank: int = 0, workers: int | None = None) -> None:
    """Memory: the index (as one machine's), one task's arrays at a time, and 1 byte per document."""
    clock = Clock()
    plan = read_plan(work)
    check_finished(work, plan, "scan", "dedup")
    opt = options_from(plan)
    cfg = load_config(opt.quality)
    mem = plan_memory(opt.memory_gb, opt.workers, opt.shard_tokens, cfg.dedup["max_index_mb"], opt.dedup)
    index = DedupIndex(mem.index_mb, near=opt.near_dedup, bands=cfg.dedup["bands"]) if opt.dedup else None
    replay, heads, dups = _Replay(index), [], []
    for t in range(plan["tasks"]):
        head, a = load_task(work, "scan", t)
        dups.append(np.zeros(head["n_raw"], dtype=np.uint8))
        replay.task(a, _ok(head, a), dups[-1])
        heads.append(head)
    replay.close()
    counts = _Counts()
    for t, (head, dup) in enumerate(zip(heads, dups)):
        counts.add(head, load_task(work, "scan", t)[1], dup)
    _check_counts(heads, counts.kept, counts.reasons())
    stats = index.stats() if index is not None else {}
    if index is not None and (line := index.full_warning(sum(st["n_docs"] for st in counts.kept.values()))):
        print(line, file=sys.stderr)
        stats["index_full_warning"] = line.removeprefix("warning: ")
    folder = fresh(task_dir(work, "dedup", rank))
    save_file({f"dup_{t:05d}": d for t, d in enumerate(dups)}, folder / "arrays.safetensors")
    mix = mix_keep_probabilities(opt.mix, counts.lang_chars) if opt.mix else None
    write_task(folder, plan, {"stage": "dedup", "kept": counts.kept, "lang_chars": counts.lang_chars,
                              "reasons": counts.reasons(), "dedup_stats": stats, "mix_keep": mix}, clock)


def _check_counts(heads: list[dict], kept: dict, reasons: list[list]) -> None:
    """The one-machine run's refusals, on the counts of all tasks."""
    n_raw = sum(h["n_raw"] for h in heads)
    skipped = [s for h in heads for s in h["skipped"]]
    if n_raw == 0:
        raise PrepareError("no documents found in the inputs" + (
            f" ({len(skipped)} unreadable file(s) skipped)" if skipped else " (all files empty)"))
    n_kept = {s: st["n_docs"] for s, st in kept.items()}
    if sum(n_kept.values()) == 0:
        raise PrepareError(f"no documents left after cleaning ({n_raw} read; removed: "
                           f"{ {r[0]: r[1] for r in reasons} })")
    for split, n in n_kept.items():
        if n == 0:
            raise PrepareError(f"the {split} split is empty ({sum(n_kept.values())} documents kept); "
                               f"add text or change --val-fraction")


# ---------------------------------------------------------------- encode


class _Watched:
    """The task's files as one source whose documents are also seen, in order, by `see(i, text)`."""

    def __init__(self, sources: list, see):
        self.sources, self.see = sources, see
        self.name = "task"

    def texts(self, text_field: str):
        for i, t in enumerate(raw_texts(self.sources, text_field)):
            self.see(i, t)
            yield t


def encode(work: Path, rank: int, workers: int = 1) -> None:
    clock = Clock()
    plan = read_plan(work)
    check_finished(work, plan, "dedup", f"encode task {rank}")
    opt = options_from(plan, workers)
    tok = Tokenizer.load(Path(work) / "tokenizer.model")
    head, a = load_task(work, "scan", rank)
    dd, dd_arrays = load_task(work, "dedup", 0)
    dup = dd_arrays[f"dup_{rank:05d}"]
    keep = _ok(head, a) & (dup == 0)
    val = a["split"] == 1
    sample = HeldOutSample(opt.eval_docs, EVAL_SAMPLE_CHARS)
    examples: dict[str, list] = {name: [] for name in DUPS}

    def see(i: int, text: str) -> None:
        if dup[i] and len(ex := examples[DUPS[dup[i] - 1]]) < EXAMPLES_PER_REASON:
            ex.append([i, (clean(text) or "")[:SNIPPET_CHARS]])
        elif keep[i] and val[i]:
            doc = clean(text) or ""
            sample.offer(hash_key(doc, SALT_EVAL, opt.seed), doc)

    counts = {s: {"n_docs": 0, "n_chars": 0, "n_bytes": 0} for s in ("train", "val")}
    counts["train"]["n_bytes"] = int(a["bytes"][keep].sum())  # only the (disabled) bar's total reads it
    cr = CleanResult(sources=[_Watched(_sources(head["readable"]), see)], skipped=[],
                     keep=bytearray(keep.astype(np.uint8).tobytes()), kept=counts)
    folder = fresh(task_dir(work, "encode", rank))
    stats, kept_chars = encode_pass(cr, opt, dd["mix_keep"], tok, folder)
    write_task(folder, plan, {"stage": "encode", "rank": rank, "stats": stats, "kept_chars": kept_chars,
                              "examples": examples, "sample": [[-k, d] for k, d in sample.heap]}, clock)

"""Pass 3, encode: kept documents as <s> ids </s> on worker processes, in input order, into
fixed-size shards (training.data.shards.ShardWriter): the same shards for any worker count."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from training.data.shards import ShardWriter
from training.prepare.clean import CleanResult, raw_texts
from training.prepare.cluster.pool import chunks, ordered_map, resolve_workers
from training.prepare.keys import split_of
from training.prepare.options import Options
from training.prepare.sample import mix_kept
from training.prepare.sources import clean
from training.runfiles.progress import bar as progress_bar
from training.text.normalization import LANGUAGES
from training.text.tokenizer import Tokenizer

_worker_tok: Tokenizer | None = None


def init_worker(proto: bytes) -> None:
    global _worker_tok
    _worker_tok = Tokenizer(proto)


def encode_chunk(docs: list[str], keep: dict[str, float] | None, val_fraction: float, seed: int,
                 dtype: str) -> dict:
    """Normalize, filter (--mix) and encode a chunk of raw kept documents; tokens and counts per split."""
    assert _worker_tok is not None
    out = {s: {"n_docs": 0, "n_bytes": 0, "n_chars": 0} for s in ("train", "val")}
    parts: dict[str, list[list[int]]] = {"train": [], "val": []}
    lang_chars = dict.fromkeys(LANGUAGES, 0)
    for text in docs:
        doc = clean(text)
        if doc is None:
            continue
        lang = mix_kept(doc, keep, seed)
        if lang is None:
            continue
        if lang:
            lang_chars[lang] += len(doc)
        split = split_of(doc, val_fraction, seed)
        parts[split].append(_worker_tok.encode(doc, bos=True, eos=True))
        s = out[split]
        s["n_docs"] += 1
        s["n_chars"] += len(doc)
        s["n_bytes"] += len(doc.encode("utf-8"))
    for split, ids in parts.items():
        out[split]["tokens"] = np.asarray([i for doc_ids in ids for i in doc_ids], dtype=dtype)
    return {"splits": out, "seen_bytes": sum(len(d.encode("utf-8")) for d in docs), "lang_chars": lang_chars}


def encode_pass(cr: CleanResult, opt: Options, keep: dict[str, float] | None, tok: Tokenizer, tmp: Path
                ) -> tuple[dict[str, dict], dict[str, int]]:
    writers = {s: ShardWriter(tmp / s, tok.vocab_size, tok.sha256, opt.shard_tokens) for s in ("train", "val")}
    stats = {s: {"n_tokens": 0, "n_shards": 0, "n_docs": 0, "n_bytes": 0, "n_chars": 0} for s in writers}
    dtype = np.dtype(writers["train"].dtype).name
    total = sum(st["n_bytes"] for st in cr.kept.values())
    bar = progress_bar(total=total, desc="encode", unit="B", unit_scale=True, unit_divisor=1000,
                       enabled=opt.progress, smoothing=0.1, leave=True)
    t0, n_tok = time.perf_counter(), 0
    kept_chars = dict.fromkeys(LANGUAGES, 0)  # per language, counted only with --mix
    kept_docs = (t for i, t in enumerate(raw_texts(cr.sources, opt.text_field)) if cr.keep[i])
    tasks = ((c, keep, opt.val_fraction, opt.seed, dtype) for c in chunks(kept_docs))
    for res in ordered_map(encode_chunk, tasks, resolve_workers(opt.workers), init_worker, (tok.proto,)):
        for split, r in res["splits"].items():
            writers[split].add(r["tokens"])
            for k in ("n_docs", "n_bytes", "n_chars"):
                stats[split][k] += r[k]
            n_tok += int(r["tokens"].size)
        for lang, n in res["lang_chars"].items():
            kept_chars[lang] += n
        bar.update(res["seen_bytes"])
        bar.set_postfix_str(f"{n_tok / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")
    bar.close()
    for split, w in writers.items():
        w.close()
        stats[split]["n_tokens"] = int(w.n_tokens)
        stats[split]["n_shards"] = int(w.n_shards)
    return stats, kept_chars

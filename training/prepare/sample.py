"""Pass 2 (only when a tokenizer is trained): the --max-sentences lines of kept training documents
with the smallest keyed hash, a deterministic sample independent of file order and worker count."""

from __future__ import annotations

import heapq

from training.prepare.clean import CleanResult, raw_texts
from training.prepare.keys import SALT_MIX, SALT_SENTENCE, hash_key, hash_unit, split_of
from training.prepare.options import Options
from training.prepare.sources import clean
from training.runfiles.progress import bar as progress_bar
from training.text.normalization import detect_language
from training.text.tokenizer import MAX_SENTENCE_BYTES


def mix_kept(doc: str, keep: dict[str, float] | None, seed: int) -> str | None:
    """The document's language if --mix keeps it ("" without --mix), None if it is sampled out."""
    if keep is None:
        return ""
    lang = detect_language(doc)
    p = keep.get(lang, 1.0)
    return lang if p >= 1.0 or hash_unit(doc, SALT_MIX, seed) < p else None


def sample_sentences(cr: CleanResult, opt: Options, keep: dict[str, float] | None) -> list[str]:
    heap: list[tuple[int, int, str]] = []  # max-heap via negated key: (-key, -n, sentence)
    n = 0
    bar = progress_bar(total=cr.n_raw, desc="sample", unit="doc", enabled=opt.progress)
    for i, text in enumerate(raw_texts(cr.sources, opt.text_field)):
        bar.update()
        if not cr.keep[i]:
            continue
        doc = clean(text)
        if doc is None or mix_kept(doc, keep, opt.seed) is None or split_of(doc, opt.val_fraction, opt.seed) == "val":
            continue
        for line in doc.split("\n"):
            if not line.strip() or len(line.encode("utf-8")) > MAX_SENTENCE_BYTES:
                continue
            n += 1
            # Ties (duplicate lines) are ordered by position, which is deterministic too.
            item = (-hash_key(line, SALT_SENTENCE, opt.seed), -n, line)
            if len(heap) < opt.max_sentences:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
    bar.close()
    heap.sort(reverse=True)
    return [s for _, _, s in heap]

"""Exact and near-duplicate detection, with a dedup index of bounded, stated size.

Exact: a keyed 64-bit hash of the normalized document with whitespace runs collapsed.
Near: MinHash (datasketch) over word 5-grams of `match_words(doc)`, cut into LSH bands; a document
is a near-duplicate when any of its band keys was seen before (a pair with Jaccard similarity s
shares a band with probability 1 - (1 - s^rows)^bands). The first copy in input order is kept.

Signatures are computed in the worker processes (`doc_keys`); the order-dependent decision runs in
the main process (`DedupIndex.check`). The index holds 64-bit keys (1 exact + `bands` per kept
document) in two fixed numpy open-addressing tables of `max_index_mb` together (the --memory-gb
plan sets it), filled to at most MAX_LOAD: 8 / 0.75 = 10.7 bytes per key, 160 MB per million
documents at 14 bands.
"""

from __future__ import annotations

import hashlib
import mmap
from functools import lru_cache

import numpy as np

from training.prepare.keys import SALT_EXACT, hash_key

MAX_LOAD = 0.75
KEY_BYTES = 8  # one uint64 slot per key
MIN_SLOTS = 1 << 10
U32 = np.uint64(0xFFFFFFFF)
NGRAM_BASE = np.uint64(0x100000001B3)


def exact_key(doc: str, seed: int) -> int:
    return hash_key(" ".join(doc.split()), SALT_EXACT, seed)


@lru_cache(maxsize=8)
def _minhash_template(num_perm: int, seed: int):
    from datasketch import MinHash  # imported by the workers only when near-dedup runs

    return MinHash(num_perm=num_perm, seed=seed)


_WORD_CACHE: dict[str, int] = {}
WORD_CACHE_MAX = 200_000  # per process, ~40 MB: word frequencies are Zipfian, so most lookups hit


def word_hashes(words: list[str]) -> np.ndarray:
    """A stable 64-bit hash per word (blake2b, cached): computed once per document, shared by the
    decontamination n-grams and the MinHash shingles."""
    cache = _WORD_CACHE
    out = np.empty(len(words), dtype=np.uint64)
    for i, w in enumerate(words):
        h = cache.get(w)
        if h is None:
            if len(cache) >= WORD_CACHE_MAX:
                cache.clear()
            h = cache[w] = int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little")
        out[i] = h
    return out


def ngram_hashes(w: np.ndarray, n: int) -> np.ndarray:
    """Stable 64-bit hashes of the n-grams of word hashes `w` (one hash of all when fewer than n)."""
    if w.size == 0:
        return w
    n = min(n, int(w.size))
    acc = np.zeros(w.size - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):  # polynomial rolling combination; uint64 arithmetic wraps on purpose
            acc = acc * NGRAM_BASE + w[j: j + acc.size]
    return acc


def extend_ngrams(acc: np.ndarray, w: np.ndarray, n: int) -> np.ndarray:
    """The (n+1)-gram hashes from the n-gram hashes `acc`: one more rolling step (same values as
    ngram_hashes(w, n + 1)), so several n-gram lengths cost one pass."""
    with np.errstate(over="ignore"):
        return acc[:-1] * NGRAM_BASE + w[n: n + acc.size - 1]


def shingle_hashes(w: np.ndarray, n: int) -> np.ndarray:
    """32-bit shingle hashes, the input datasketch's MinHash permutations expect."""
    acc = ngram_hashes(w, n)
    return (acc ^ (acc >> np.uint64(32))) & U32


def band_keys(w: np.ndarray, *, shingle_words: int, num_perm: int, bands: int, seed: int) -> np.ndarray:
    """The LSH band keys (uint64, one per band) of a document's MinHash signature; `w`: word_hashes."""
    hv = shingle_hashes(w, shingle_words)
    m = _minhash_template(num_perm, seed).copy()
    if hv.size:
        # datasketch's update_batch applies hashfunc per item; our hashes are already 32-bit ints.
        m.hashfunc = int
        m.update_batch(hv.tolist())
    sig = m.hashvalues.astype(np.uint64).reshape(bands, num_perm // bands)
    rows = np.arange(1, sig.shape[1] + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = (sig * np.uint64(0x9E3779B97F4A7C15) ^ rows).sum(axis=1, dtype=np.uint64)
        keys = keys * np.uint64(0xBF58476D1CE4E5B9) + np.arange(bands, dtype=np.uint64)  # distinct per band
    return keys


class U64Set:
    """A set of uint64 keys in one numpy array of fixed size (open addressing, linear probing,
    0 = empty). The table never grows: `room` is how many more keys fit under MAX_LOAD and add()
    refuses more, so its memory is bounded by construction."""

    def __init__(self, n_slots: int):
        # An anonymous mapping, not np.zeros: numpy asks for huge pages on large arrays, so a few
        # random keys would make the OS back (and zero) the whole table at once; here each 4 KiB
        # page is backed when the first key lands in it, and a small corpus costs little.
        self._mem = mmap.mmap(-1, max(int(n_slots), MIN_SLOTS) * 8)
        self.slots = np.frombuffer(self._mem, dtype=np.uint64)
        self.n = np.uint64(self.slots.size)
        self.size = 0

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes)

    @property
    def room(self) -> int:
        return int(MAX_LOAD * self.slots.size) - self.size

    @staticmethod
    def _fix(keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.uint64)
        return np.where(keys == 0, np.uint64(1), keys)

    def _next(self, slot: np.ndarray) -> np.ndarray:
        slot = slot + np.uint64(1)
        return np.where(slot == self.n, np.uint64(0), slot)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        keys = self._fix(keys)
        slot = keys % self.n
        found = np.zeros(keys.size, dtype=bool)
        active = np.arange(keys.size)
        while active.size:
            v = self.slots[slot[active]]
            hit = v == keys[active]
            found[active[hit]] = True
            active = active[~(hit | (v == 0))]
            slot[active] = self._next(slot[active])
        return found

    def add(self, keys: np.ndarray) -> None:
        keys = np.unique(self._fix(keys))
        keys = keys[~self.contains(keys)]
        if keys.size > self.room:
            raise ValueError(f"U64Set full: {keys.size:,} new keys, room for {self.room:,}")
        self._insert(keys)

    def _insert(self, keys: np.ndarray) -> None:
        """Insert distinct absent keys: each round, one key per empty slot wins, the rest probe on."""
        pending, slot = keys, keys % self.n
        while pending.size:
            empty = np.flatnonzero(self.slots[slot] == 0)
            _, first = np.unique(slot[empty], return_index=True)
            win = empty[first]
            self.slots[slot[win]] = pending[win]
            lost = np.ones(pending.size, dtype=bool)
            lost[win] = False
            pending, slot = pending[lost], self._next(slot[lost])
        self.size += keys.size


def index_bytes_per_doc(keys_per_doc: int, load: float = MAX_LOAD) -> float:
    """Index bytes one kept document costs with its keys filled to `load`."""
    return keys_per_doc * KEY_BYTES / load


class DedupIndex:
    """The order-dependent half of deduplication: first copy kept, later exact/near copies dropped.

    Two fixed tables sized from `max_index_mb` at the start (exact keys: 1 slot in 1 + bands,
    band keys: the rest), so the index never holds more than its cap. When a chunk's keys no longer
    fit under MAX_LOAD, indexing stops (`full_after`): later documents are still checked against
    everything indexed so far, but no longer added."""

    def __init__(self, max_index_mb: float, near: bool = True, bands: int = 14):
        slots = int(max_index_mb * (1 << 20)) // KEY_BYTES
        exact_slots = slots // (1 + bands) if near else slots
        self.exact = U64Set(exact_slots)
        self.bands = U64Set(slots - exact_slots) if near else None
        self.max_bytes = int(max_index_mb * (1 << 20))
        self.near = near
        self.n_bands = bands
        self.full_after: int | None = None  # documents indexed when the cap was reached
        self.n_indexed = 0

    def check(self, exact: int, bands: np.ndarray | None) -> str | None:
        """'exact_duplicate', 'near_duplicate', or None (kept: its keys join the index)."""
        b = None if bands is None else bands[None, :]
        return self.check_chunk(np.array([exact], dtype=np.uint64), b)[0]

    def check_chunk(self, exact: np.ndarray, bands: np.ndarray | None) -> list[str | None]:
        """check() for the documents of a chunk, in order: one vectorized lookup against the index,
        Python sets for copies inside the chunk, one vectorized insert at the end."""
        near = self.near and bands is not None and self.bands is not None
        in_exact = self.exact.contains(exact)
        in_bands = self.bands.contains(bands.ravel()).reshape(bands.shape).any(axis=1) if near else None
        new_e: set[int] = set()
        new_b: set[int] = set()
        kept_b: list[np.ndarray] = []
        out: list[str | None] = []
        for i, e in enumerate(exact.tolist()):
            if in_exact[i] or e in new_e:
                out.append("exact_duplicate")
                continue
            row = bands[i].tolist() if near else []
            if near and (in_bands[i] or not new_b.isdisjoint(row)):
                out.append("near_duplicate")
                continue
            out.append(None)
            if self.full_after is None:
                new_e.add(e)
                new_b.update(row)
                if near:
                    kept_b.append(bands[i])
        if new_e:
            kb = np.concatenate(kept_b) if kept_b else None
            if len(new_e) > self.exact.room or (kb is not None and kb.size > self.bands.room):
                self.full_after = self.n_indexed  # the cap: this chunk and all later ones stay out
            else:
                self.exact.add(np.fromiter(new_e, dtype=np.uint64, count=len(new_e)))
                if kb is not None:
                    self.bands.add(kb)
                self.n_indexed += len(new_e)
        return out

    @property
    def nbytes(self) -> int:
        return self.exact.nbytes + (self.bands.nbytes if self.bands is not None else 0)

    @property
    def capacity_docs(self) -> int:
        """Kept documents the tables take before indexing stops."""
        cap = self.exact.size + self.exact.room
        if self.bands is not None:
            cap = min(cap, (self.bands.size + self.bands.room) // self.n_bands)
        return int(cap)

    @property
    def keys_per_doc(self) -> int:
        return 1 + (self.n_bands if self.bands is not None else 0)

    def full_warning(self, kept_docs: int) -> str | None:
        """One line when indexing stopped (None otherwise): copies among the documents after that
        point were not caught, which a falling loss would never show. Says what to raise."""
        if self.full_after is None:
            return None
        mb_per_million = index_bytes_per_doc(self.keys_per_doc)  # bytes per document = MB per million documents
        need_mb = kept_docs * mb_per_million / (1 << 20)
        return (f"warning: the dedup index ({self.max_bytes / 2**20:.0f} MiB) filled after {self.full_after:,} "
                f"of {kept_docs:,} kept documents: later ones were checked against those but copies among "
                f"them were kept; an index for all needs ~{need_mb:,.0f} MiB ({mb_per_million:.0f} MB per "
                f"million documents): raise --memory-gb, run fewer --workers, or split with --num-shards")

    def stats(self) -> dict:
        return {"indexed_docs": self.n_indexed, "index_bytes": self.nbytes,
                "exact_keys": self.exact.size, "band_keys": self.bands.size if self.bands is not None else 0,
                "index_capacity_docs": self.capacity_docs,
                "index_full_after_docs": self.full_after}

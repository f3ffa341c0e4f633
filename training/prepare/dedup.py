"""Exact and near-duplicate detection, with a dedup index of bounded, stated size.

Exact: a keyed 64-bit hash of the normalized document with whitespace runs collapsed.
Near: MinHash (datasketch) over word 5-grams of `match_words(doc)`, cut into LSH bands; a document
is a near-duplicate when any of its band keys was seen before (a pair with Jaccard similarity s
shares a band with probability 1 - (1 - s^rows)^bands). The first copy in input order is kept.

Signatures are computed in the worker processes (`doc_keys`); the order-dependent decision runs in
the main process (`DedupIndex.check`). The index holds 64-bit keys (1 exact + `bands` per kept
document) in a numpy open-addressing table: 8 bytes per slot at load 0.375-0.75, i.e. 11-21 bytes
per key, about 165-320 MB per million documents at 14 bands, capped by `max_index_mb`.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from training.prepare.keys import SALT_EXACT, hash_key

MAX_LOAD = 0.75
MIN_CAPACITY = 1 << 16
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
    """A set of uint64 keys in one numpy array (open addressing, linear probing, 0 = empty)."""

    def __init__(self, capacity: int = MIN_CAPACITY):
        cap = MIN_CAPACITY
        while cap < capacity:
            cap <<= 1
        self.slots = np.zeros(cap, dtype=np.uint64)
        self.size = 0

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes)

    @staticmethod
    def _fix(keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.uint64)
        return np.where(keys == 0, np.uint64(1), keys)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        keys = self._fix(keys)
        mask = np.uint64(self.slots.size - 1)
        slot = keys & mask
        found = np.zeros(keys.size, dtype=bool)
        active = np.arange(keys.size)
        while active.size:
            v = self.slots[slot[active]]
            hit = v == keys[active]
            found[active[hit]] = True
            active = active[~(hit | (v == 0))]
            slot[active] = (slot[active] + np.uint64(1)) & mask
        return found

    def add(self, keys: np.ndarray) -> None:
        keys = np.unique(self._fix(keys))
        keys = keys[~self.contains(keys)]
        if (self.size + keys.size) > MAX_LOAD * self.slots.size:
            self._grow(self.size + keys.size)
        self._insert(keys)

    def _grow(self, need: int) -> None:
        cap = self.slots.size
        while need > MAX_LOAD * cap:
            cap <<= 1
        old = self.slots[self.slots != 0]
        self.slots = np.zeros(cap, dtype=np.uint64)
        self.size = 0
        self._insert(old)

    def _insert(self, keys: np.ndarray) -> None:
        """Insert distinct absent keys: each round, one key per empty slot wins, the rest probe on."""
        mask = np.uint64(self.slots.size - 1)
        pending, slot = keys, keys & mask
        while pending.size:
            empty = np.flatnonzero(self.slots[slot] == 0)
            _, first = np.unique(slot[empty], return_index=True)
            win = empty[first]
            self.slots[slot[win]] = pending[win]
            lost = np.ones(pending.size, dtype=bool)
            lost[win] = False
            pending, slot = pending[lost], (slot[lost] + np.uint64(1)) & mask
        self.size += keys.size


class DedupIndex:
    """The order-dependent half of deduplication: first copy kept, later exact/near copies dropped."""

    def __init__(self, max_index_mb: int, near: bool = True):
        self.exact, self.bands = U64Set(), U64Set()
        self.max_bytes = max_index_mb << 20
        self.near = near
        self.full_after: int | None = None  # documents indexed when the cap was reached
        self.n_indexed = 0

    def check(self, exact: int, bands: np.ndarray | None) -> str | None:
        """'exact_duplicate', 'near_duplicate', or None (kept: its keys join the index)."""
        b = None if bands is None else bands[None, :]
        return self.check_chunk(np.array([exact], dtype=np.uint64), b)[0]

    def check_chunk(self, exact: np.ndarray, bands: np.ndarray | None) -> list[str | None]:
        """check() for the documents of a chunk, in order: one vectorized lookup against the index,
        Python sets for copies inside the chunk, one vectorized insert at the end."""
        near = self.near and bands is not None
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
            if self.nbytes >= self.max_bytes:
                self.full_after = self.n_indexed
            else:
                self.exact.add(np.fromiter(new_e, dtype=np.uint64, count=len(new_e)))
                if kept_b:
                    self.bands.add(np.concatenate(kept_b))
                self.n_indexed += len(new_e)
        return out

    @property
    def nbytes(self) -> int:
        return self.exact.nbytes + self.bands.nbytes

    def stats(self) -> dict:
        return {"indexed_docs": self.n_indexed, "index_bytes": self.nbytes,
                "exact_keys": self.exact.size, "band_keys": self.bands.size,
                "index_full_after_docs": self.full_after}

"""Keyed 64-bit hashes of text: deterministic across runs, machines, worker counts and shards.

Distinct salts keep the decisions independent: the split, the --mix sample, the tokenizer's
sentence sample, the report's held-out sample, exact deduplication and the shard a document
belongs to must not be correlated.
"""

from __future__ import annotations

import hashlib

SALT_SPLIT, SALT_MIX, SALT_SENTENCE, SALT_EVAL = b"split", b"mix", b"sentence", b"eval"
SALT_EXACT, SALT_SHARD = b"exact", b"shard"
HASH_SCALE = float(1 << 64)


def hash_key(text: str, salt: bytes, seed: int) -> int:
    """A 64-bit keyed hash of the text."""
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=seed.to_bytes(8, "little"),
                        salt=salt.ljust(16, b"\0"))
    return int.from_bytes(h.digest(), "little")


def hash_unit(text: str, salt: bytes, seed: int) -> float:
    """A uniform number in [0, 1) from the text."""
    return hash_key(text, salt, seed) / HASH_SCALE


def split_of(doc: str, val_fraction: float, seed: int) -> str:
    """A document's split is a hash of its text: identical documents always land together."""
    return "val" if hash_unit(doc, SALT_SPLIT, seed) < val_fraction else "train"


def shard_of(exact_key: int, num_shards: int) -> int:
    """The --shard-index that owns a document: by its exact-duplicate key, so all copies of a
    document meet on one machine and exact deduplication stays global across shards."""
    return exact_key % num_shards

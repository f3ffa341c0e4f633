"""The token-shard format of a prepared DATA_DIR: writer, reader, and its meta.json. Free of torch
on purpose: `training.prepare` writes and merges shards with numpy alone; training.data.loaders holds the
torch loaders that draw batches from them.

A shard is a 64-byte little-endian header followed by the tokens:
    magic b"PRODIPTK" | version u32 | itemsize u32 (2: uint16, 4: uint32) | n_tokens u64 |
    vocab_size u32 | reserved u32 | sha256 of the tokenizer model (32 bytes)
A DATA_DIR holds `tokenizer.model`, `meta.json`, `report.json` and `train/`, `val/` shard folders.
Documents are stored as <s> ids </s>, back to back.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.runfiles import layout
from training.text.tokenizer import Tokenizer

MAGIC = b"PRODIPTK"
VERSION = 1
HEADER = struct.Struct("<8sIIQII32s")
HEADER_SIZE = 64
assert HEADER.size <= HEADER_SIZE
DTYPES = {2: np.uint16, 4: np.uint32}


class DataError(ValueError):
    pass


def itemsize_for_vocab(vocab_size: int) -> int:
    return 2 if vocab_size <= 65535 else 4


@dataclass(frozen=True)
class ShardHeader:
    itemsize: int
    n_tokens: int
    vocab_size: int
    tokenizer_sha256: str

    def pack(self) -> bytes:
        raw = HEADER.pack(MAGIC, VERSION, self.itemsize, self.n_tokens, self.vocab_size, 0,
                          bytes.fromhex(self.tokenizer_sha256))
        return raw.ljust(HEADER_SIZE, b"\0")


def read_header(path: Path) -> ShardHeader:
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE:
        raise DataError(f"{path}: truncated shard header ({len(raw)} of {HEADER_SIZE} bytes)")
    magic, version, itemsize, n, vocab, _, sha = HEADER.unpack(raw[: HEADER.size])
    if magic != MAGIC:
        raise DataError(f"{path}: not a prodip token shard (bad magic {magic!r})")
    if version != VERSION:
        raise DataError(f"{path}: shard version {version}, this prodip reads version {VERSION}")
    if itemsize not in DTYPES:
        raise DataError(f"{path}: unknown token dtype (itemsize {itemsize})")
    expected = HEADER_SIZE + n * itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise DataError(f"{path}: truncated or padded shard: header says {n} tokens ({expected} bytes), file has {actual} bytes")
    return ShardHeader(itemsize, n, vocab, sha.hex())


def write_shard(path: Path, tokens: np.ndarray, vocab_size: int, tokenizer_sha256: str) -> None:
    """Write atomically (temp file + rename): a shard on disk is always complete."""
    itemsize = itemsize_for_vocab(vocab_size)
    arr = np.asarray(tokens, dtype=DTYPES[itemsize])
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(ShardHeader(itemsize, int(arr.size), vocab_size, tokenizer_sha256).pack())
        f.write(arr.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: Path) -> np.ndarray:
    h = read_header(path)
    return np.memmap(path, dtype=DTYPES[h.itemsize], mode="r", offset=HEADER_SIZE, shape=(h.n_tokens,))


class ShardWriter:
    """Accumulates tokens and writes fixed-size shards named shard_00000.bin, ..."""

    def __init__(self, folder: Path, vocab_size: int, tokenizer_sha256: str, shard_tokens: int = 1 << 26):
        self.folder, self.vocab_size, self.sha = folder, vocab_size, tokenizer_sha256
        self.shard_tokens = shard_tokens
        self.dtype = DTYPES[itemsize_for_vocab(vocab_size)]
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.n_shards = 0
        self.n_tokens = 0
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, ids: list[int] | np.ndarray) -> None:
        a = np.asarray(ids, dtype=self.dtype)
        self.buf.append(a)
        self.buffered += a.size
        self.n_tokens += a.size
        while self.buffered >= self.shard_tokens:
            flat = np.concatenate(self.buf)
            self._write(flat[: self.shard_tokens])
            rest = flat[self.shard_tokens:]
            self.buf, self.buffered = [rest], rest.size

    def _write(self, arr: np.ndarray) -> None:
        write_shard(self.folder / f"shard_{self.n_shards:05d}.bin", arr, self.vocab_size, self.sha)
        self.n_shards += 1

    def close(self) -> None:
        if self.buffered:
            self._write(np.concatenate(self.buf))
        self.buf, self.buffered = [], 0


class TokenStream:
    """All shards of one split as one read-only token array (memory-mapped, nothing loaded)."""

    def __init__(self, data_dir: Path, split: str, *, vocab_size: int | None = None, tokenizer_sha256: str | None = None):
        folder = Path(data_dir) / split
        paths = sorted(folder.glob("shard_*.bin"))
        if not paths:
            raise DataError(f"no {split} shards in {folder}; run `python -m training.prepare` first")
        self.paths = paths
        self.parts: list[np.ndarray] = []
        for p in paths:
            h = read_header(p)
            if tokenizer_sha256 is not None and h.tokenizer_sha256 != tokenizer_sha256:
                raise DataError(f"{p} was tokenized with another tokenizer (sha256 {h.tokenizer_sha256[:12]}…, "
                                f"expected {tokenizer_sha256[:12]}…); re-run prepare with this tokenizer")
            if vocab_size is not None and h.vocab_size != vocab_size:
                raise DataError(f"{p}: vocab size {h.vocab_size} differs from the model's {vocab_size}")
            self.parts.append(read_shard(p))
        self.offsets = np.cumsum([0] + [len(a) for a in self.parts])
        self.n_tokens = int(self.offsets[-1])

    def slice(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        filled = 0
        i = int(np.searchsorted(self.offsets, start, side="right") - 1)
        pos = start
        while filled < length:
            part_start = int(self.offsets[i])
            part = self.parts[i]
            take = min(length - filled, len(part) - (pos - part_start))
            out[filled: filled + take] = part[pos - part_start: pos - part_start + take]
            filled += take
            pos += take
            i += 1
        return out


def decoded_documents(data_dir: Path, split: str) -> list[str]:
    """The documents of one split, read back from its shards and decoded (each is <s> ids </s>):
    exactly the text the model trains or is evaluated on, for reports and checks."""
    tok = Tokenizer.load(data_dir)
    ids = np.concatenate(TokenStream(data_dir, split).parts).tolist()
    docs, cur = [], []
    for t in ids:
        if t == tok.bos_id:
            cur = []
        elif t == tok.eos_id:
            docs.append(tok.decode(cur))
        else:
            cur.append(t)
    return docs


# what training reads of a data folder's meta.json and report.json (training.prepare writes more)
DATA_META_SCHEMA: layout.Schema = {"vocab_size": int, "tokenizer_sha256": str, "splits": dict}
DATA_REPORT_SECTIONS = ("fertility", "gate_options")


def _read_json(path: Path, what: str, **schema) -> dict:
    try:
        return layout.read_json(path, what, **schema)
    except layout.LayoutError as e:
        raise DataError(str(e)) from None


def read_meta(data_dir: Path) -> dict:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory not found: {data_dir}")
    if not (data_dir / layout.DATA_META).is_file():
        raise DataError(f"{data_dir} is not a prepared data directory (no {layout.DATA_META}); "
                        "run `python -m training.prepare`")
    meta = _read_json(data_dir / layout.DATA_META, "data meta", required=DATA_META_SCHEMA, version=layout.DATA_FORMAT)
    for split, stats in meta["splits"].items():
        if not isinstance(stats, dict):
            raise DataError(f"{data_dir / layout.DATA_META}: data meta: splits.{split} must be an object")
    return meta

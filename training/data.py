"""Token shards: the on-disk format, its writer, and a loader that knows its exact position.

A shard is a 64-byte little-endian header followed by the tokens:
    magic b"PRODIPTK" | version u32 | itemsize u32 (2: uint16, 4: uint32) | n_tokens u64 |
    vocab_size u32 | reserved u32 | sha256 of the tokenizer model (32 bytes)
A DATA_DIR holds `tokenizer.model`, `meta.json`, `report.json` and `train/`, `val/` shard folders.
Documents are stored as <s> ids </s>, back to back.

Training reads non-overlapping windows of seq_len+1 tokens (stride seq_len) from the concatenated
stream, in a fresh seeded permutation each epoch. The loader's whole state is one integer, the
number of windows consumed (across all ranks), so a resumed run continues with the exact batch it
would have drawn, and rank r of W takes windows r, r+W, ... of each step's block: no overlap, no gaps.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"PRODIPTK"
VERSION = 1
HEADER = struct.Struct("<8sIIQII32s")
HEADER_SIZE = 64
assert HEADER.size <= HEADER_SIZE
DTYPES = {2: np.uint16, 4: np.uint32}
SPLITS = ("train", "val")


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


class WindowLoader:
    """Deterministic windows of `seq_len + 1` tokens; state = windows consumed (global)."""

    def __init__(self, stream: TokenStream, seq_len: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True):
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.n_windows = (stream.n_tokens - 1) // seq_len
        if self.n_windows < world_size:
            raise DataError(f"only {stream.n_tokens} tokens: fewer than {world_size} windows of {seq_len + 1}; "
                            "use a shorter --seq-len or more data")
        self.consumed = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n_windows, generator=g).numpy()
            else:
                self._perm = np.arange(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def window_index(self, g: int) -> int:
        """Start-window index of global window number g (g counts across epochs and ranks)."""
        epoch, k = divmod(g, self.n_windows)
        return int(self._order(epoch)[k])

    def window(self, index: int) -> np.ndarray:
        return self.stream.slice(index * self.seq_len, self.seq_len + 1)

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), each (batch_size, seq_len); advances the global position."""
        rows = []
        for b in range(batch_size):
            g = self.consumed + b * self.world_size + self.rank
            rows.append(self.window(self.window_index(g)))
        self.consumed += batch_size * self.world_size
        x = torch.from_numpy(np.stack(rows))
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seq_len": self.seq_len, "seed": self.seed, "n_windows": self.n_windows}

    def load_state_dict(self, s: dict) -> None:
        if s["seq_len"] != self.seq_len or s["n_windows"] != self.n_windows:
            raise DataError(f"data position was saved for seq_len={s['seq_len']} over {s['n_windows']} windows; "
                            f"now seq_len={self.seq_len} over {self.n_windows} windows (different data or --seq-len)")
        self.consumed = int(s["consumed"])


def read_meta(data_dir: Path) -> dict:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory not found: {data_dir}")
    meta = data_dir / "meta.json"
    if not meta.is_file():
        raise DataError(f"{data_dir} is not a prepared data directory (no meta.json); run `python -m training.prepare`")
    return json.loads(meta.read_text())


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

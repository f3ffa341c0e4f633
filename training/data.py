"""Token shards (the on-disk format and its writer) and the loaders training draws batches from.

A shard is a 64-byte little-endian header followed by the tokens:
    magic b"PRODIPTK" | version u32 | itemsize u32 (2: uint16, 4: uint32) | n_tokens u64 |
    vocab_size u32 | reserved u32 | sha256 of the tokenizer model (32 bytes)
A DATA_DIR holds `tokenizer.model`, `meta.json`, `report.json` and `train/`, `val/` shard folders.
Documents are stored as <s> ids </s>, back to back.

Every loader is a `Loader`: `next_batch(b)`, and its whole position in `state_dict()`. Both kinds,
pretraining windows (`WindowLoader`: non-overlapping windows of seq_len+1 tokens, stride seq_len) and
SFT conversations (`ConversationLoader`: one right-padded conversation per row), draw items through
one `EpochOrder` (a fresh seeded permutation each epoch) and one position, the number of items
consumed across all ranks: a resumed run continues with the exact batch it would have drawn, and
rank r of W takes items r, r+W, ... of each step's block: no overlap, no gaps.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from training import layout
from training.tokenizer import Tokenizer

if TYPE_CHECKING:  # type hints only: data.py needs neither at run time
    from training.config import TrainConfig
    from training.distributed import Dist

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


# ------------------------------------------------------------------------------------------ loaders
Batch = tuple[torch.Tensor, ...]  # (x, y), or (x, y, loss_mask) where some targets do not count


class Loader(Protocol):
    """What the training loop draws micro-batches from. The whole position is `state_dict()`: a run
    resumed with it draws exactly the batch it would have drawn."""

    def next_batch(self, batch_size: int) -> Batch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class EpochOrder:
    """Item `g` of an endless stream over `n` items (g counts across epochs): each epoch a fresh
    permutation seeded by (seed, epoch), or 0..n-1 in order. The one shuffle of every loader."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._epoch, self._perm = -1, np.arange(0)

    def __getitem__(self, g: int) -> int:
        epoch, k = divmod(g, self.n)
        if epoch != self._epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n, generator=gen).numpy()
            else:
                self._perm = np.arange(self.n)
            self._epoch = epoch
        return int(self._perm[k])


class _StridedLoader:
    """The position every loader shares: items consumed across all ranks; rank r of W takes items
    r, r+W, ... of each block, so the ranks of one step draw disjoint items and together no gaps."""

    def __init__(self, n: int, *, seed: int, rank: int, world_size: int, shuffle: bool):
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.order = EpochOrder(n, seed, shuffle)
        self.consumed = 0

    def _take(self, batch_size: int) -> list[int]:
        """This rank's item indices for one micro-batch; advances the global position."""
        idx = [self.order[self.consumed + b * self.world_size + self.rank] for b in range(batch_size)]
        self.consumed += batch_size * self.world_size
        return idx


class WindowLoader(_StridedLoader):
    """Pretraining: deterministic windows of `seq_len + 1` tokens; state = windows consumed (global)."""

    def __init__(self, stream: TokenStream, seq_len: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True):
        self.stream, self.seq_len = stream, seq_len
        self.n_windows = (stream.n_tokens - 1) // seq_len
        if self.n_windows < world_size:
            raise DataError(f"only {stream.n_tokens} tokens: fewer than {world_size} windows of {seq_len + 1}; "
                            "use a shorter --seq-len or more data")
        super().__init__(self.n_windows, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle)

    def window_index(self, g: int) -> int:
        """Start-window index of global window number g (g counts across epochs and ranks)."""
        return self.order[g]

    def window(self, index: int) -> np.ndarray:
        return self.stream.slice(index * self.seq_len, self.seq_len + 1)

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), each (batch_size, seq_len); advances the global position."""
        x = torch.from_numpy(np.stack([self.window(i) for i in self._take(batch_size)]))
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seq_len": self.seq_len, "seed": self.seed, "n_windows": self.n_windows}

    def load_state_dict(self, s: dict) -> None:
        if s.get("kind", "windows") != "windows":
            raise DataError(f"the checkpoint's data position is a {s['kind']!r} one, not pretraining windows")
        if s["seq_len"] != self.seq_len or s["n_windows"] != self.n_windows:
            raise DataError(f"data position was saved for seq_len={s['seq_len']} over {s['n_windows']} windows; "
                            f"now seq_len={self.seq_len} over {self.n_windows} windows (different data or --seq-len)")
        self.consumed = int(s["consumed"])


@dataclass
class Row:
    """One conversation as one training row (SFT)."""

    ids: np.ndarray  # int64, at most seq_len + 1 tokens, starting with <s>
    mask: np.ndarray  # 0/1 per token of ids: 1 on assistant content and its <|im_end|>
    truncated: bool


def collate(rows: Sequence[Row], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, loss_mask), each (len(rows), seq_len): right-padded; loss_mask[t] = assistant_mask[t + 1]."""
    x = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    y = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    m = np.zeros((len(rows), seq_len), dtype=np.float32)
    for i, r in enumerate(rows):
        n = len(r.ids) - 1
        x[i, :n], y[i, :n], m[i, :n] = r.ids[:-1], r.ids[1:], r.mask[1:]
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(m)


def fingerprint(rows: Sequence[Row], seq_len: int) -> str:
    """Short hash of every row's tokens and mask: a resumed run must see the very same rows."""
    h = hashlib.sha256(str(seq_len).encode())
    for r in rows:
        h.update(r.ids.tobytes())
        h.update(r.mask.astype(np.uint8).tobytes())
    return h.hexdigest()[:16]


CONVERSATIONS = "sft"  # a conversation loader's position says so (older checkpoints hold this spelling)


class ConversationLoader(_StridedLoader):
    """SFT: deterministic batches of conversation rows; state = rows consumed (global, across ranks).

    `data_gates(ctx)`, when given, replaces the window data gates (training.gates asks the loader):
    padded conversations are compared whole, since shared padding is no overlap."""

    def __init__(self, rows: Sequence[Row], seq_len: int, pad_id: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, data_gates: Callable[[object], list] | None = None):
        if len(rows) < world_size:
            raise DataError(f"only {len(rows)} training conversations for {world_size} processes")
        self.rows, self.seq_len, self.pad_id = list(rows), seq_len, pad_id
        self.n_rows = len(self.rows)
        self.fingerprint = fingerprint(self.rows, seq_len)
        self._gates = data_gates
        super().__init__(self.n_rows, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle)

    def row_index(self, g: int) -> int:
        return self.order[g]

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return collate([self.rows[i] for i in self._take(batch_size)], self.seq_len, self.pad_id)

    def state_dict(self) -> dict:
        epoch, index = divmod(self.consumed, self.n_rows)
        return {"kind": CONVERSATIONS, "consumed": self.consumed, "epoch": epoch, "index": index,
                "n_rows": self.n_rows, "seq_len": self.seq_len, "seed": self.seed, "fingerprint": self.fingerprint}

    def load_state_dict(self, s: dict) -> None:
        if s.get("kind") != CONVERSATIONS:
            raise DataError("the checkpoint's data position is not an SFT one (resuming a pretraining run as SFT?)")
        if (s["n_rows"], s["seq_len"], s["fingerprint"]) != (self.n_rows, self.seq_len, self.fingerprint):
            raise DataError(f"data position was saved for {s['n_rows']} conversations at seq_len {s['seq_len']} "
                            f"(fingerprint {s['fingerprint']}); now {self.n_rows} at {self.seq_len} ({self.fingerprint}): "
                            "different --data, --seq-len or tokenizer; use the original ones or another --out")
        self.consumed = int(s["consumed"])

    def data_gates(self, ctx) -> list:
        return self._gates(ctx) if self._gates else []


# ------------------------------------------------------------------------------- what a run reads
@dataclass
class TrainingData:
    """Everything a run draws from; the pre-flight gates read it as `ctx.batches`."""

    train: Loader
    val: Callable[[int], list[Batch]] | None  # n global batches -> this rank's fixed validation micro-batches
    bytes_per_token: float | None  # UTF-8 bytes per counted validation token: for bits per byte
    tokenizer: Tokenizer
    data_meta: dict
    data_report: dict | None


class WindowValidation:
    """The validation split's windows, in order, the same ones at every evaluation."""

    def __init__(self, loader: WindowLoader, batch_size: int):
        self.loader, self.batch_size = loader, batch_size

    def __call__(self, n: int) -> list[Batch]:
        # n micro-batches (batch_size rows on each rank): an evaluation costs the same whatever
        # --grad-accum is, and sees the same windows at every world size with the same batch_size x world
        v, world = self.loader, self.loader.world_size
        v.consumed = 0
        k = min(n, max(1, v.n_windows // (self.batch_size * world)))
        return [v.next_batch(min(self.batch_size, v.n_windows // world)) for _ in range(k)]


class Prefetcher:
    """A Loader whose next micro-batch is drawn one call ahead and handed to `to_device` at once (a
    pinned, non-blocking copy on CUDA): the host builds and queues it while the device still runs the
    micro-batch before, and never waits for a copy. Its position
    (`state_dict`) is that of the batches handed out: the one drawn ahead is not consumed, so a
    checkpoint resumes exactly. Other attributes are the wrapped loader's."""

    def __init__(self, loader: Loader, to_device: Callable[[Batch], Batch]):
        self.loader, self.to_device = loader, to_device
        self.ahead: tuple[int, Batch, dict] | None = None  # (batch_size, batch, the position before it)

    def next_batch(self, batch_size: int) -> Batch:
        if self.ahead is not None and self.ahead[0] == batch_size:
            batch = self.ahead[1]
        else:  # first call, or another batch size: drop what was drawn ahead
            self.drop_ahead()
            batch = self.to_device(self.loader.next_batch(batch_size))
        before = self.loader.state_dict()
        self.ahead = (batch_size, self.to_device(self.loader.next_batch(batch_size)), before)
        return batch

    def drop_ahead(self) -> None:
        if self.ahead is not None:
            self.loader.load_state_dict(self.ahead[2])
            self.ahead = None

    def state_dict(self) -> dict:
        return self.ahead[2] if self.ahead is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ahead = None
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def pretraining_data(cfg: TrainConfig, d: Dist) -> TrainingData:
    """A prepared DATA_DIR (training.prepare) as this rank's training windows and validation batches."""
    data = Path(cfg.data)
    meta = read_meta(data)
    tok = Tokenizer.load(data / layout.TOKENIZER)
    if meta["tokenizer_sha256"] != tok.sha256:
        raise DataError(f"{data}/{layout.TOKENIZER} does not match the tokenizer recorded in {layout.DATA_META}")
    train_split, val_split = layout.SPLITS
    train = WindowLoader(TokenStream(data, train_split, vocab_size=tok.vocab_size, tokenizer_sha256=tok.sha256),
                         cfg.seq_len, seed=cfg.seed, rank=d.rank, world_size=d.world_size)
    val, bpt = None, None
    if any((data / val_split).glob("shard_*.bin")):
        vstream = TokenStream(data, val_split, vocab_size=tok.vocab_size, tokenizer_sha256=tok.sha256)
        if (vstream.n_tokens - 1) // cfg.seq_len >= d.world_size:  # every rank needs a window
            vloader = WindowLoader(vstream, cfg.seq_len, seed=0, shuffle=False, rank=d.rank, world_size=d.world_size)
            val = WindowValidation(vloader, cfg.batch_size)
            vs = meta["splits"].get(val_split, {})
            if isinstance(vs.get("n_bytes"), int | float) and isinstance(vs.get("n_tokens"), int) and vs["n_tokens"] > 0:
                bpt = vs["n_bytes"] / vs["n_tokens"]
    report = None
    if (data / layout.DATA_REPORT).is_file():  # optional; what the tokenizer gates read of it must be objects
        report = _read_json(data / layout.DATA_REPORT, "data report")
        for section in DATA_REPORT_SECTIONS:
            if not isinstance(report.get(section, {}), dict):
                raise DataError(f"{data / layout.DATA_REPORT}: data report: {section!r} must be an object")
    return TrainingData(train, val, bpt, tok, meta, report)


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

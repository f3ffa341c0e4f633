"""The loaders training draws batches from (torch); the shard format they read is training.data.shards.

Every loader is a `Loader`: `next_batch(b)`, and its whole position in `state_dict()`. Both kinds,
pretraining windows (`WindowLoader`: non-overlapping windows of seq_len+1 tokens, stride seq_len) and
SFT conversations (`ConversationLoader`: one right-padded conversation per row), draw items through
one `EpochOrder` (a fresh seeded permutation each epoch) and one position, the number of items
consumed across all ranks: a resumed run continues with the exact batch it would have drawn, and
rank r of W takes items r, r+W, ... of each step's block: no overlap, no gaps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from training.data.shards import (  # the format's names callers take from here stay importable (#26 split)
    DATA_REPORT_SECTIONS,
    HEADER,
    HEADER_SIZE,
    DataError,
    ShardWriter,
    TokenStream,
    _read_json,
    decoded_documents,
    read_header,
    read_meta,
    read_shard,
    write_shard,
)
from training.runfiles import layout
from training.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # type hints only: data.py needs neither at run time
    from training.distributed import Dist
    from training.train_config import TrainConfig

__all__ = [  # the shard format's names re-exported above, and this module's own
    "HEADER", "HEADER_SIZE", "DataError", "ShardWriter", "TokenStream", "decoded_documents", "read_header",
    "read_meta", "read_shard", "write_shard",
    "Batch", "Loader", "EpochOrder", "WindowLoader", "Row", "collate", "fingerprint", "CONVERSATIONS",
    "ConversationLoader", "TrainingData", "WindowValidation", "Prefetcher", "pretraining_data",
]
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


CONVERSATIONS = layout.SFT_KIND  # a conversation loader's position says so (older checkpoints hold this spelling)


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

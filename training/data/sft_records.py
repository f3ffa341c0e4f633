"""SFT data: conversation records (OpenAI messages, Alpaca, ShareGPT) -> split -> one row each, and the
data gates that judge them. training/sft.py runs the fine-tuning; this module is what it trains on.

Each conversation is rendered by training.text.chat_template (the one ChatML template) into its own row of at most
seq_len + 1 tokens (training.data.loaders.ConversationLoader pads and batches them). A conversation longer
than the row is cut, one whose assistant turns all lie beyond it is dropped; both are counted.
Validation: the records whose "split" is a held-out split (test/validation/dev) when any has one,
else a deterministic 5 % by content hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from training.data.loaders import CONVERSATIONS, ConversationLoader, Row, TrainingData, collate
from training.distributed import Dist
from training.gates import GateResult
from training.runfiles import json_records as records
from training.runfiles import layout
from training.text.chat_template import ChatError, encode, validate
from training.text.tokenizer import Tokenizer
from training.train_config import TrainConfig

KIND = CONVERSATIONS  # the run kind in run.json and state.json: "sft"
HELD_OUT_SPLITS = ("test", "validation", "val", "dev")
HASH_VAL_FRACTION = 0.05  # when no record names a split
HASH_SALT = b"prodip-sft-val"
NO_REPEAT_ROWS = 64  # data.no_repeats: conversations drawn from the loader
MAX_TRUNCATED_SHARE = 0.25  # data.truncation gate: above this share cut or dropped, --seq-len is too short
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "bot": "assistant", "system": "system"}


class SFTError(ValueError):
    pass


# -------------------------------------------------------------------------------------- records
@dataclass
class Record:
    messages: list[dict]
    split: str | None
    where: str  # "file:line", for error messages


def to_messages(obj: object, where: str) -> list[dict]:
    """One record in any supported shape -> validated, normalized chat messages."""
    if not isinstance(obj, dict):
        raise SFTError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list):
            raise SFTError(f"{where}: 'messages' must be a list")
    elif "instruction" in obj and "output" in obj:
        user, extra = obj["instruction"], obj.get("input")
        if extra:
            if not isinstance(user, str) or not isinstance(extra, str):
                raise SFTError(f"{where}: 'instruction' and 'input' must be strings")
            user = f"{user}\n\n{extra}"  # the Alpaca convention: instruction, blank line, input
        msgs = ([{"role": "system", "content": obj["system"]}] if obj.get("system") else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": obj["output"]}]
    elif "conversations" in obj and isinstance(obj["conversations"], list):
        msgs = []
        for i, m in enumerate(obj["conversations"]):
            role = SHAREGPT_ROLES.get(str(m.get("from", "")).lower()) if isinstance(m, dict) else None
            if role is None:
                raise SFTError(f"{where}: conversations[{i}] needs 'from' in {sorted(SHAREGPT_ROLES)} and 'value'")
            msgs.append({"role": role, "content": m.get("value")})
    else:
        raise SFTError(f"{where}: expected 'messages', Alpaca 'instruction'/'output', or ShareGPT 'conversations'; "
                       f"got keys {sorted(obj)[:8]}")
    try:
        msgs = validate(msgs)
    except ChatError as e:
        raise SFTError(f"{where}: {e}") from None
    if not any(m["role"] == "assistant" for m in msgs):
        raise SFTError(f"{where}: no assistant message, nothing to learn from")
    return msgs


def read_conversations(path: str | os.PathLike) -> list[Record]:
    """Conversations of a JSONL file or JSON array, through the one record reader (training.runfiles.json_records)."""
    out = []
    for rec in records.read_records(path, "chat data", SFTError):
        obj = rec.value
        split = obj.get("split") if isinstance(obj, dict) else None
        out.append(Record(to_messages(obj, rec.where), str(split) if split is not None else None, rec.where))
    if not out:
        raise SFTError(f"{path}: no records")
    return out


def _hash_unit(messages: list[dict]) -> float:
    key = json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(HASH_SALT + key).digest()[:8], "big") / float(1 << 64)


def split_records(records: Sequence[Record]) -> tuple[list[Record], list[Record], str]:
    """(train, val, how): by the records' own held-out split if any names one, else by hash."""
    if any(r.split in HELD_OUT_SPLITS for r in records):
        return ([r for r in records if r.split not in HELD_OUT_SPLITS],
                [r for r in records if r.split in HELD_OUT_SPLITS], "split field")
    val = [_hash_unit(r.messages) < HASH_VAL_FRACTION for r in records]
    return ([r for r, v in zip(records, val) if not v], [r for r, v in zip(records, val) if v],
            f"hash {HASH_VAL_FRACTION:.0%}")


# ----------------------------------------------------------------------------------------- rows
def encode_row(tok: Tokenizer, messages: list[dict], seq_len: int) -> Row | None:
    """The conversation as one row, cut to seq_len + 1 tokens; None if no assistant token survives."""
    enc = encode(tok, messages, add_generation_prompt=False)
    ids, mask = enc.ids[: seq_len + 1], enc.assistant_mask[: seq_len + 1]
    if not any(mask[1:]):
        return None
    return Row(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64), len(enc.ids) > seq_len + 1)


def _unpadded(batch: tuple, pad_id: int) -> list[np.ndarray]:
    """Each row of a collated batch as its conversation's token ids (padding removed)."""
    x, y = batch[0].numpy(), batch[1].numpy()
    full = np.concatenate([x[:, :1], y], axis=1)  # y is the row shifted by one: [x0] + y is all of it
    return [row[row != pad_id] for row in full]  # <pad> is a control token: text never contains it


# -------------------------------------------------------------------------------------- dataset
@dataclass
class SFTData:
    """The encoded conversations of every --data file, split, with counts for the report."""

    tokenizer: Tokenizer
    seq_len: int
    files: list[str]
    train: list[Row]
    val: list[Row]
    split_by: str
    stats: dict = field(default_factory=dict)

    @classmethod
    def load(cls, files: Sequence[str], tok: Tokenizer, seq_len: int) -> SFTData:
        if not files:
            raise SFTError("--data is required (a JSONL file of conversations)")
        records = [r for f in files for r in read_conversations(f)]
        train_recs, val_recs, how = split_records(records)
        stats = {"records": len(records), "split_by": how}
        rows: dict[str, list[Row]] = {}
        for name, recs in (("train", train_recs), ("val", val_recs)):
            enc = [encode_row(tok, r.messages, seq_len) for r in recs]
            kept = [r for r in enc if r is not None]
            rows[name] = kept
            stats[name] = {"conversations": len(kept), "truncated": sum(r.truncated for r in kept),
                           "dropped_no_assistant_in_window": len(enc) - len(kept),
                           "tokens": int(sum(len(r.ids) - 1 for r in kept)),
                           "assistant_tokens": int(sum(int(r.mask[1:].sum()) for r in kept))}
        if not rows["train"]:
            raise SFTError(f"no training conversations in {', '.join(files)} (all {len(val_recs)} are held out, "
                           "or none fits --seq-len)")
        return cls(tok, seq_len, list(files), rows["train"], rows["val"], how, stats)

    def bytes_per_target(self) -> float | None:
        """UTF-8 bytes per counted (assistant) token over the validation rows, for bits per byte."""
        n_tok = n_bytes = 0
        for r in self.val:
            m = r.mask[1:].astype(bool)
            tgt = r.ids[1:]
            n_tok += int(m.sum())
            # contiguous assistant spans decode to their text (<|im_end|> is a control token: 0 bytes)
            edges = np.flatnonzero(np.diff(np.concatenate(([0], m.astype(np.int8), [0]))))
            for a, b in zip(edges[::2], edges[1::2]):
                n_bytes += len(self.tokenizer.decode(tgt[a:b].tolist()).encode("utf-8"))
        return n_bytes / n_tok if n_tok and n_bytes else None

    def data_gates(self, ctx) -> list[GateResult]:
        """The data pre-flight gates for conversations (training.gates defers to the loader's).

        Rows are compared without their padding, and train/val overlap is by whole conversation: a
        shared system prompt or instruction is no leak, an identical conversation is."""
        vocab = ctx.model_cfg.vocab_size
        hi = max(int(r.ids.max()) for r in self.train + self.val)
        out = [GateResult("data.token_range", hi < vocab, value=float(hi), threshold=f"< {vocab}",
                          detail=f"max token id {hi} over all {len(self.train) + len(self.val)} conversations, "
                                 f"vocabulary {vocab}")]
        loader, bs = ctx.batches.train, ctx.cfg.batch_size
        k = min(NO_REPEAT_ROWS, len(self.train))  # beyond one epoch, rows repeat by design
        state = loader.state_dict()
        try:
            drawn = [row for _ in range(-(-k // bs)) for row in _unpadded(loader.next_batch(bs), self.tokenizer.pad_id)]
        finally:
            loader.load_state_dict(state)
        keys = [hashlib.sha1(r.tobytes()).digest() for r in drawn[:k]]
        dup = len(keys) - len(set(keys))
        out.append(GateResult("data.no_repeats", dup == 0, value=float(dup), threshold="0 repeated conversations",
                              detail=f"{dup} repeats among the first {len(keys)} conversations the loader yields"
                                     + (" (duplicated records in --data?)" if dup else "")))
        return out + self.content_gates()

    def content_gates(self) -> list[GateResult]:
        """The gates the conversations alone decide (no model, no loader): run_sft checks them before
        anything is written, and the pre-flight report records them with the others."""
        out = []
        if self.val:
            train_keys = {hashlib.sha1(r.ids.tobytes()).digest() for r in self.train}
            overlap = sum(hashlib.sha1(r.ids.tobytes()).digest() in train_keys for r in self.val)
            out.append(GateResult("data.train_val_disjoint", overlap == 0, value=float(overlap), threshold="0",
                                  detail=f"{overlap} of {len(self.val)} validation conversations also appear in training"
                                         + (" (the same record in both splits?)" if overlap else "")))
        tr = self.stats["train"]
        cut, dropped = tr["truncated"], tr["dropped_no_assistant_in_window"]
        share = (cut + dropped) / (len(self.train) + dropped)
        out.append(GateResult("data.truncation", share <= MAX_TRUNCATED_SHARE, value=share,
                              threshold=f"<= {MAX_TRUNCATED_SHARE:.0%} of conversations cut or dropped",
                              detail=f"{cut} of {len(self.train) + dropped} training conversations are longer than "
                                     f"--seq-len {self.seq_len} and were cut, {dropped} dropped (no assistant token "
                                     "within it)" + (" (raise --seq-len)" if cut or dropped else "")))
        return out

    def check_content(self, skip: Sequence[str]) -> None:
        """SFTError (one line) when a content gate fails and --skip-gate does not name it or "data"."""
        failed = [g for g in self.content_gates() if not g.passed and g.name not in skip and "data" not in skip]
        if failed:
            raise SFTError("SFT data refused, nothing written: " + "; ".join(f"{g.name}: {g.detail}" for g in failed)
                           + f" (--skip-gate {failed[0].name} to train anyway)")

    def training_data(self, cfg: TrainConfig, d: Dist) -> TrainingData:
        """What the Trainer draws from (its `data_factory`): this rank's conversation loader and the
        fixed validation batches."""
        if cfg.seq_len != self.seq_len:
            raise SFTError(f"data was encoded for seq_len {self.seq_len}, the run uses {cfg.seq_len}")
        loader = ConversationLoader(self.train, self.seq_len, self.tokenizer.pad_id, seed=cfg.seed, rank=d.rank,
                                    world_size=d.world_size, data_gates=self.data_gates)
        val_fn = None
        if self.val:
            def val_fn(n: int) -> list[tuple]:
                bs = cfg.batch_size
                k = min(n, math.ceil(len(self.val) / bs))
                return [collate(self.val[i * bs:(i + 1) * bs], self.seq_len, self.tokenizer.pad_id) for i in range(k)]
        meta = {"kind": KIND, "files": self.files, "split_by": self.split_by, **self.stats}
        return TrainingData(loader, val_fn, self.bytes_per_target(), self.tokenizer, meta,
                            layout.pretraining_data_report(cfg.init))

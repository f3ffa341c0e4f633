"""Supervised fine-tuning on conversations, through the one training loop (training.train.train).

    python training/sft.py --init RUN_OR_CHECKPOINT --data FILE.jsonl [--data FILE2.jsonl] --out SFT_RUN
           [--epochs 3 | --max-steps N] [every training/train.py flag that makes sense]

Records are JSONL (or one JSON array) in any of these shapes:
    {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}    (OpenAI-style)
    {"instruction": ..., "input": ..., "output": ..., "system"?: ...}               (Alpaca)
    {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}       (ShareGPT)
Each conversation is rendered by training.chat (the one ChatML template) into its own row of
seq_len + 1 tokens, right-padded with <pad>: one conversation per row, so with causal attention no
conversation can attend to another, and padding never reaches a real token. The loss counts
assistant tokens only (their content and the <|im_end|> that ends the turn): with y = ids shifted by
one, loss_mask[t] = assistant_mask[t + 1]. A conversation longer than the row is cut (and counted).
Validation: the records whose "split" is a held-out split (test/validation/dev) when any has one,
else a deterministic 5 % by content hash. The weights come from --init, whose tokenizer the run
keeps; the run folder, gates and checkpoints are exactly those of pretraining (config kind "sft"),
so export, serving and the demo take an SFT run like any other.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as `python training/sft.py`: make the repo root importable
    import sys
    from pathlib import Path as _P

    sys.path.insert(0, str(_P(__file__).resolve().parents[1]))

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from training import checkpoint as ckpt
from training import distributed as D
from training import train as T
from training.chat import ChatError, encode, validate
from training.cli import guarded
from training.config import ConfigError, TrainConfig, load_toml
from training.gates import GateResult
from training.model import ModelConfig
from training.text import read_utf8
from training.tokenizer import Tokenizer, TokenizerError

KIND = "sft"
REPORT_FILE = "sft_data.json"
HELD_OUT_SPLITS = ("test", "validation", "val", "dev")
HASH_VAL_FRACTION = 0.05  # when no record names a split
HASH_SALT = b"prodip-sft-val"
DEFAULT_EPOCHS = 3.0
NO_REPEAT_ROWS = 64  # data.no_repeats: conversations drawn from the loader
MAX_TRUNCATED_SHARE = 0.25  # data.truncation gate: above this, --seq-len is too short for the data
REPORT_MAX_VAL_ROWS = 512  # the before/after held-out loss in sft_data.json reads at most this many
# Fine-tuning defaults that differ from pretraining's (a TOML file or a flag still overrides them).
# No weight decay: it would pull the pretrained weights toward zero. The peak LR is a fraction of the
# --init run's own: lower, so the pretrained weights are not pulled away, but not so low that one
# batch cannot be memorized (the overfit_one_batch gate trains with it: at 1/10 a tiny model fails).
SFT_DEFAULTS: dict[str, object] = {"weight_decay": 0.0, "warmup_steps": 10, "eval_every": 50, "save_every": 100}
SFT_LR_SCALE = 1 / 3  # default --lr: this times the --init run's peak LR
FALLBACK_LR = 1e-3  # when the --init checkpoint does not record its LR
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


def read_records(path: str | os.PathLike) -> list[Record]:
    p = Path(path)
    text = read_utf8(p, "chat data", SFTError)
    items: Iterable[tuple[str, object]]
    if text.lstrip().startswith("["):  # one JSON array (the original Alpaca release ships so)
        try:
            arr = json.loads(text)
        except json.JSONDecodeError as e:
            raise SFTError(f"{p}: invalid JSON ({e})") from None
        items = ((f"{p}[{i}]", o) for i, o in enumerate(arr))
    else:
        def lines():
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        yield f"{p}:{n}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SFTError(f"{p}:{n}: invalid JSON ({e.msg})") from None
        items = lines()
    out = []
    for where, obj in items:
        split = obj.get("split") if isinstance(obj, dict) else None
        out.append(Record(to_messages(obj, where), str(split) if split is not None else None, where))
    if not out:
        raise SFTError(f"{p}: no records")
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
@dataclass
class Row:
    ids: np.ndarray  # int64, at most seq_len + 1 tokens, starting with <s>
    mask: np.ndarray  # 0/1 per token of ids: 1 on assistant content and its <|im_end|>
    truncated: bool


def encode_row(tok: Tokenizer, messages: list[dict], seq_len: int) -> Row | None:
    """The conversation as one row, cut to seq_len + 1 tokens; None if no assistant token survives."""
    enc = encode(tok, messages, add_generation_prompt=False)
    ids, mask = enc.ids[: seq_len + 1], enc.assistant_mask[: seq_len + 1]
    if not any(mask[1:]):
        return None
    return Row(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64), len(enc.ids) > seq_len + 1)


def collate(rows: Sequence[Row], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, loss_mask), each (len(rows), seq_len): right-padded; loss_mask[t] = assistant_mask[t + 1]."""
    x = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    y = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    m = np.zeros((len(rows), seq_len), dtype=np.float32)
    for i, r in enumerate(rows):
        n = len(r.ids) - 1
        x[i, :n], y[i, :n], m[i, :n] = r.ids[:-1], r.ids[1:], r.mask[1:]
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(m)


def _unpadded(batch: tuple, pad_id: int) -> list[np.ndarray]:
    """Each row of a collated batch as its conversation's token ids (padding removed)."""
    x, y = batch[0].numpy(), batch[1].numpy()
    full = np.concatenate([x[:, :1], y], axis=1)  # y is the row shifted by one: [x0] + y is all of it
    return [row[row != pad_id] for row in full]  # <pad> is a control token: text never contains it


def _fingerprint(rows: Sequence[Row], seq_len: int) -> str:
    h = hashlib.sha256(str(seq_len).encode())
    for r in rows:
        h.update(r.ids.tobytes())
        h.update(r.mask.astype(np.uint8).tobytes())
    return h.hexdigest()[:16]


class ConversationLoader:
    """Deterministic batches of conversation rows; state = rows consumed (global, across ranks).

    As WindowLoader: a fresh seeded permutation each epoch, rank r of W takes rows r, r+W, ... of each
    step's block, and a resumed run draws exactly the batch it would have drawn."""

    def __init__(self, rows: Sequence[Row], seq_len: int, pad_id: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, gates: Callable[[object], list[GateResult]] | None = None):
        if len(rows) < world_size:
            raise SFTError(f"only {len(rows)} training conversations for {world_size} processes")
        self.rows, self.seq_len, self.pad_id, self.seed = list(rows), seq_len, pad_id, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.n_rows = len(self.rows)
        self.fingerprint = _fingerprint(self.rows, seq_len)
        self.consumed = 0
        self._gates = gates
        self._perm_epoch, self._perm = -1, np.arange(0)

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n_rows, generator=g).numpy()
            else:
                self._perm = np.arange(self.n_rows)
            self._perm_epoch = epoch
        return self._perm

    def row_index(self, g: int) -> int:
        epoch, k = divmod(g, self.n_rows)
        return int(self._order(epoch)[k])

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = [self.row_index(self.consumed + b * self.world_size + self.rank) for b in range(batch_size)]
        self.consumed += batch_size * self.world_size
        return collate([self.rows[i] for i in idx], self.seq_len, self.pad_id)

    def state_dict(self) -> dict:
        epoch, index = divmod(self.consumed, self.n_rows)
        return {"kind": KIND, "consumed": self.consumed, "epoch": epoch, "index": index, "n_rows": self.n_rows,
                "seq_len": self.seq_len, "seed": self.seed, "fingerprint": self.fingerprint}

    def load_state_dict(self, s: dict) -> None:
        if s.get("kind") != KIND:
            raise SFTError("the checkpoint's data position is not an SFT one (resuming a pretraining run as SFT?)")
        if (s["n_rows"], s["seq_len"], s["fingerprint"]) != (self.n_rows, self.seq_len, self.fingerprint):
            raise SFTError(f"data position was saved for {s['n_rows']} conversations at seq_len {s['seq_len']} "
                           f"(fingerprint {s['fingerprint']}); now {self.n_rows} at {self.seq_len} ({self.fingerprint}): "
                           "different --data, --seq-len or tokenizer; use the original ones or another --out")
        self.consumed = int(s["consumed"])

    def data_gates(self, ctx) -> list[GateResult]:
        return self._gates(ctx) if self._gates else []


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
        records = [r for f in files for r in read_records(f)]
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
        """The data pre-flight gates for conversations (training.gates_data defers to this).

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
        if self.val:
            train_keys = {hashlib.sha1(r.ids.tobytes()).digest() for r in self.train}
            overlap = sum(hashlib.sha1(r.ids.tobytes()).digest() in train_keys for r in self.val)
            out.append(GateResult("data.train_val_disjoint", overlap == 0, value=float(overlap), threshold="0",
                                  detail=f"{overlap} of {len(self.val)} validation conversations also appear in training"))
        cut = self.stats["train"]["truncated"]
        share = cut / len(self.train)
        out.append(GateResult("data.truncation", share <= MAX_TRUNCATED_SHARE, value=share,
                              threshold=f"<= {MAX_TRUNCATED_SHARE:.0%} of conversations cut",
                              detail=f"{cut} of {len(self.train)} training conversations are longer than --seq-len "
                                     f"{self.seq_len} and were cut" + (" (raise --seq-len)" if cut else "")))
        return out

    def batches_factory(self, cfg: TrainConfig, d: D.Dist) -> T.Batches:
        """What training.train.train draws from (the `batches_factory` hook)."""
        if cfg.seq_len != self.seq_len:
            raise SFTError(f"data was encoded for seq_len {self.seq_len}, the run uses {cfg.seq_len}")
        loader = ConversationLoader(self.train, self.seq_len, self.tokenizer.pad_id, seed=cfg.seed, rank=d.rank,
                                    world_size=d.world_size, gates=self.data_gates)
        val_fn = None
        if self.val:
            def val_fn(n: int) -> list[tuple]:
                bs = cfg.batch_size
                k = min(n, math.ceil(len(self.val) / bs))
                return [collate(self.val[i * bs:(i + 1) * bs], self.seq_len, self.tokenizer.pad_id) for i in range(k)]
        meta = {"kind": KIND, "files": self.files, "split_by": self.split_by, **self.stats}
        return T.Batches(loader, val_fn, self.bytes_per_target(), self.tokenizer, meta, pretraining_report(cfg.init))


# ------------------------------------------------------------------------------------- measuring
@torch.no_grad()
def heldout_loss(model: torch.nn.Module, rows: Sequence[Row], seq_len: int, pad_id: int, *, batch_size: int = 16,
                 device: str | torch.device = "cpu") -> float:
    """Mean cross-entropy (nats) over every assistant token of `rows` (token-weighted, not per batch)."""
    if not rows:
        raise SFTError("no held-out conversations to measure")
    total, count = 0.0, 0.0
    was = model.training
    model.eval()
    for i in range(0, len(rows), batch_size):
        x, y, m = collate(rows[i:i + batch_size], seq_len, pad_id)
        _, s = model(x.to(device), y.to(device), loss_mask=m.to(device), reduction="sum")
        total += float(s)
        count += float(m.sum())
    model.train(was)
    return total / count


# ------------------------------------------------------------------------------------------- run
def init_checkpoint(init: str) -> tuple[Path, ModelConfig, Tokenizer]:
    """The --init checkpoint folder, its model config and its tokenizer (weights are read by the loop)."""
    if not init:
        raise SFTError("--init is required (the pretrained run folder or checkpoint to fine-tune)")
    c = ckpt.resolve(init)
    try:
        cfg = ModelConfig.from_dict(json.loads((c / ckpt.CONFIG_FILE).read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise SFTError(f"{c}: unreadable model config ({e})") from None
    return c, cfg, Tokenizer.load(c / ckpt.TOKENIZER_FILE)


def pretraining_report(init: str, max_hops: int = 8) -> dict | None:
    """DATA_DIR/report.json of the pretraining data behind `init` (following SFT-on-SFT inits), if found.

    The tokenizer gates then judge the tokenizer (which SFT keeps) on the pretraining corpus's
    held-out documents, as pretraining did, rather than on short chat turns."""
    path = init
    for _ in range(max_hops):
        if not path:
            return None
        try:
            c = ckpt.resolve(path)
        except ckpt.CheckpointError:
            return None
        run = c.parent.parent if c.parent.name == "checkpoints" else c
        try:
            run_cfg = json.loads((run / T.RUN_CONFIG).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        train_cfg = run_cfg.get("train", {})
        if run_cfg.get("kind") != KIND:
            data = train_cfg.get("data", "")
            rep = Path(data) / "report.json"
            try:
                return json.loads(rep.read_text()) if data and rep.is_file() else None
            except json.JSONDecodeError:
                return None
        path = train_cfg.get("init", "")
    return None


def check_out_dir(out: Path, init_dir: Path) -> None:
    """SFT writes its own run folder: never the --init run's, never another kind of run's."""
    out = out.resolve()
    if out == init_dir.resolve() or out in init_dir.resolve().parents:
        raise SFTError(f"--out {out} is (or holds) the --init checkpoint; fine-tune into a new run folder")
    cfg_file = out / T.RUN_CONFIG
    if cfg_file.is_file():
        try:
            old = json.loads(cfg_file.read_text())
        except json.JSONDecodeError:
            return  # train.prepare_run_dir reports it
        if old.get("kind") != KIND:
            raise SFTError(f"--out {out} holds a {old.get('kind')!r} run, not an SFT run; choose another --out")
        old_init = old.get("train", {}).get("init", "")
        if old_init and Path(old_init).resolve() != init_dir.resolve():
            # resuming would silently ignore the new --init: the run there was fine-tuned from another
            raise SFTError(f"--out {out} holds an SFT run from --init {old_init}, not {init_dir}; "
                           "choose another --out (or delete that one)")


def default_lr(init: str) -> float:
    """SFT_LR_SCALE x the peak LR the --init checkpoint was trained with (FALLBACK_LR if unrecorded)."""
    c = ckpt.resolve(init)
    try:
        lr = json.loads((c / ckpt.STATE_FILE).read_text()).get("train", {}).get("lr")
    except (OSError, json.JSONDecodeError):
        lr = None
    return float(lr) * SFT_LR_SCALE if isinstance(lr, (int, float)) and lr > 0 else FALLBACK_LR


def epochs_to_steps(epochs: float, n_rows: int, cfg: TrainConfig, world_size: int) -> int:
    return max(1, math.ceil(epochs * n_rows / (cfg.batch_size * cfg.grad_accum * world_size)))


def run_sft(cfg: TrainConfig, *, force: bool = False, epochs: float | None = None, quiet: bool = False) -> dict:
    """Fine-tune `cfg.init` on the conversations in `cfg.data` (os.pathsep-separated files) into `cfg.out`.

    `epochs` (when given) sets max_steps from the number of training conversations. Returns the
    loop's summary plus the data report, which is also written to OUT/sft_data.json."""
    init_dir, init_cfg, tok = init_checkpoint(cfg.init)
    check_out_dir(Path(cfg.out), init_dir)
    # the model is the init's exactly; --set may only repeat it (the loop checks)
    cfg = dataclasses.replace(cfg, init=str(init_dir),
                              model={**{k: v for k, v in init_cfg.to_dict().items() if k != "vocab_size"}, **cfg.model})
    data = SFTData.load([f for f in cfg.data.split(os.pathsep) if f], tok, cfg.seq_len)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if epochs is not None:
        cfg = dataclasses.replace(cfg, max_steps=epochs_to_steps(epochs, len(data.train), cfg, world), max_tokens=0)
    is_main = int(os.environ.get("RANK", "0")) == 0
    say = print if is_main and not quiet else (lambda *a, **k: None)
    tr = data.stats["train"]
    say(f"SFT data: {len(data.train)} training / {len(data.val)} validation conversations ({data.split_by}); "
        f"{tr['assistant_tokens']:,} of {tr['tokens']:,} training tokens are assistant tokens; "
        f"{tr['truncated']} cut to --seq-len {cfg.seq_len}, {tr['dropped_no_assistant_in_window']} dropped "
        f"(no assistant token within it)")
    summary = T.train(cfg, force=force, batches_factory=data.batches_factory, kind=KIND)
    report = {"init": str(init_dir), "files": data.files, "seq_len": cfg.seq_len, "split_by": data.split_by,
              **data.stats, "max_steps": cfg.max_steps}
    if is_main and data.val:
        report["heldout"] = compare_heldout(init_dir, Path(cfg.out), data, cfg)
        h = report["heldout"]
        say(f"held-out assistant-token loss ({h['conversations']} conversations): {h['init_loss']:.4f} before SFT "
            f"-> {h['sft_loss']:.4f} after")
    if is_main:
        (Path(cfg.out) / REPORT_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return {**summary, "sft": report}


def compare_heldout(init_dir: Path, out: Path, data: SFTData, cfg: TrainConfig) -> dict:
    """Held-out assistant-token loss of the --init weights and of the newest SFT checkpoint."""
    device = "cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    rows = data.val[:REPORT_MAX_VAL_ROWS]
    res = {"conversations": len(rows)}
    for key, path in (("init_loss", init_dir), ("sft_loss", out)):
        model, ck = ckpt.load_model(path, device=device)
        res[key] = heldout_loss(model, rows, data.seq_len, data.tokenizer.pad_id, batch_size=cfg.batch_size,
                                device=device)
        if key == "sft_loss":
            res["sft_checkpoint"] = str(ck.path)
        del model
    return res


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """training/train.py's parser (every flag of the loop), with SFT's --data, --init and --epochs."""
    # conflict_handler="resolve": --data / --init below replace the pretraining ones
    p = argparse.ArgumentParser(prog="python training/sft.py", description=__doc__, parents=[T.build_parser()],
                                formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve",
                                add_help=False,
                                epilog="SFT defaults (instead of the pretraining ones shown above): "
                                       + ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in SFT_DEFAULTS.items())
                                       + f", --lr {SFT_LR_SCALE:.3g} x the --init run's (else {FALLBACK_LR:g})"
                                       + ", --seq-len: the --init model's max_seq_len")
    p.add_argument("--data", action="append", required=True, metavar="FILE.jsonl",
                   help="conversations (messages / Alpaca / ShareGPT JSONL); repeatable")
    p.add_argument("--init", required=True, metavar="RUN_OR_CHECKPOINT", help="the pretrained weights to fine-tune")
    p.add_argument("--epochs", type=float, default=None,
                   help=f"passes over the training conversations (default {DEFAULT_EPOCHS:g} unless --max-steps/--max-tokens)")
    return p


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, float | None]:
    """(TrainConfig, epochs or None). Precedence: SFT defaults < TOML < flags, as in train.py."""
    toml_keys = set(load_toml(args.config)) if args.config else set()
    ns = copy.copy(args)
    ns.data = os.pathsep.join(args.data)
    for k, v in SFT_DEFAULTS.items():
        if getattr(ns, k) is None and k not in toml_keys:
            setattr(ns, k, v)
    if ns.seq_len is None and "seq_len" not in toml_keys:
        _, init_cfg, _ = init_checkpoint(args.init)
        ns.seq_len = init_cfg.max_seq_len  # default: the whole context the model was trained for
    if ns.lr is None and "lr" not in toml_keys:
        ns.lr = default_lr(args.init)
    epochs = args.epochs
    steps_given = any(getattr(args, k) is not None or k in toml_keys for k in ("max_steps", "max_tokens"))
    if epochs is not None and steps_given:
        raise ConfigError("give --epochs or --max-steps/--max-tokens, not both")
    if epochs is None and not steps_given:
        epochs = DEFAULT_EPOCHS
    if epochs is not None:
        if epochs <= 0:
            raise ConfigError("--epochs must be > 0")
        ns.max_steps = 1  # placeholder for validation; run_sft derives the real count from the data
    return T.config_from_args(ns), epochs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> None:
        cfg, epochs = config_from_args(args)
        run_sft(cfg, force=args.force, epochs=epochs)

    return guarded(go, debug=args.debug, errors=(*T.USER_ERRORS, T.TrainError, SFTError, TokenizerError, OSError),
                   interrupted_hint=T.RESUME_HINT)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

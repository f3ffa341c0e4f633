"""The one checkpoint format: safetensors for tensors, JSON for everything else; no pickle anywhere.

    RUN_DIR/checkpoints/step_0000100/
        model.safetensors   weights (tied output head stored once, as tok_embeddings.weight)
        optim.safetensors   optimizer moments keyed "<param name>/<moment>" + RNG states "rng/<name>"
        state.json          step, tokens, data position, scheduler, optimizer hyper-parameters, ...
        config.json         the ModelConfig
        tokenizer.model     the SentencePiece model the weights were trained with

Under FSDP2 a checkpoint is sharded instead (nothing gathered): model.rankRRRRR-of-WWWWW.safetensors and
optim.rankRRRRR-of-WWWWW.safetensors per writing rank, and shards.json, which says which rows of each
tensor each file holds (training.checkpoint.checkpoint_format). `load` assembles the full tensors (ShardedReader),
so every stage reads either form the same way.

A checkpoint is written into a hidden temporary folder, fsynced, and renamed into place: a folder
named step_* is complete by construction, and `latest()` never sees a partial save. Non-finite
weights are refused before anything is written.

The format (names, schema, listing) is training.checkpoint.checkpoint_format; writing (the atomic write, keep-N,
the background CheckpointWriter) is training.checkpoint.checkpoint_write; this module reads, and is the one name
every stage imports: both halves' public names are re-exported here. Everything it reads is verified
by training.checkpoint.checkpoint_verify on the way (state.json's step and counters, config.json strictly, finite
tensors, the shard files' recorded sizes and sha256), so a resume, --init, an export, an evaluation
and the server refuse the same damage with the same line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from training.checkpoint.checkpoint_format import (
    ADAM_MOMENTS,
    CONFIG_FILE,
    CPU_RNG,
    FORMAT_VERSION,
    MODEL_FILE,
    OPTIM_FILE,
    RESUME_STATE_SCHEMA,
    RNG_PREFIX,
    SHARD_FORMAT,
    SHARD_INDEX_FILE,
    SHARD_KINDS,
    STATE_FILE,
    STATE_SCHEMA,
    STEP_PREFIX,
    TMP_PREFIX,
    TOKENIZER_FILE,
    CheckpointError,
    flatten_optimizer,
    has_weights,
    is_sharded,
    latest,
    list_checkpoints,
    remove,
    resolve,
    shard_file,
    step_dir_name,
    step_of,
    unflatten_optimizer,
)
from training.checkpoint.checkpoint_verify import (
    check_digest,
    check_fits,
    check_optimizer_fits,
    check_size,
    check_state,
    check_tensors_finite,
    recorded_digests,
    strict_model_config,
)
from training.checkpoint.checkpoint_write import (
    CheckpointWriter,
    begin_sharded,
    check_finite,
    commit_sharded,
    drop_tied,
    nonfinite,
    save,
    shard_index,
    sharded_tmp,
    weights_for_save,
    write,
    write_shard,
)
from training.model.decoder import ModelConfig, Transformer
from training.runfiles import layout
from training.text.tokenizer import Tokenizer

__all__ = [
    # the format (training.checkpoint.checkpoint_format)
    "ADAM_MOMENTS", "CONFIG_FILE", "CPU_RNG", "FORMAT_VERSION", "MODEL_FILE", "OPTIM_FILE", "RESUME_STATE_SCHEMA",
    "RNG_PREFIX", "SHARD_FORMAT", "SHARD_INDEX_FILE", "SHARD_KINDS", "STATE_FILE", "STATE_SCHEMA", "STEP_PREFIX",
    "TMP_PREFIX", "TOKENIZER_FILE", "CheckpointError", "flatten_optimizer", "has_weights", "is_sharded", "latest",
    "list_checkpoints", "remove", "resolve", "shard_file", "step_dir_name", "step_of", "unflatten_optimizer",
    # writing (training.checkpoint.checkpoint_write)
    "CheckpointWriter", "begin_sharded", "check_finite", "commit_sharded", "drop_tied", "nonfinite", "save",
    "shard_index", "sharded_tmp", "weights_for_save", "write", "write_shard",
    # reading (here)
    "PICKLE_HEADS", "Checkpoint", "ShardedReader", "check_fits", "check_optimizer_fits", "check_readable", "load",
    "load_model", "load_weights", "open_tensors", "read_config", "read_state", "unreadable_tensors",
]


# torch.save's zip archive and raw pickle (protocols 2-5): named as such when refused, never unpickled
PICKLE_HEADS = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def unreadable_tensors(path: Path, err: Exception) -> str:
    """Why safetensors refused `path`, in one line (a pickle payload is called out: it could run code)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        head = b""
    if head.startswith(PICKLE_HEADS):
        return (f"{path} is a pickle (torch.save) file, not safetensors; refused: prodip never unpickles, since "
                "loading a pickle can run arbitrary code. Re-save the tensors with safetensors")
    return f"{path}: truncated or corrupted safetensors file ({err})"


def check_readable(c: Path) -> None:
    """Headers and sizes of a checkpoint's tensor files (cheap: nothing is read), so a resume can fail
    before it writes anything into the run folder."""
    if is_sharded(c):
        ShardedReader(c, "model").close()  # opens every shard file the index lists: headers only
        return
    for f in (c / MODEL_FILE, c / OPTIM_FILE):
        if f.name == OPTIM_FILE and not f.is_file():
            continue
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(unreadable_tensors(f, e)) from None


SHARD_INDEX_SCHEMA: layout.Schema = {"prodip_shards": int, "world_size": int, "files": list,
                                     **{kind: dict for kind in SHARD_KINDS}}
STORED_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16,
                                                              torch.float64, torch.uint8, torch.int64)}


class ShardedReader:
    """The tensors of one section ("model" or "optim") of a sharded checkpoint, each assembled from
    every rank's rows on request (`get_tensor`), checked against shards.json: every shard file
    present and readable, each part's shape and dtype, the parts covering every row once. Any
    fault is one CheckpointError naming the file. Every listed shard file is opened (headers only)
    when the reader is made; use it as a context manager, or close() it."""

    def __init__(self, c: Path, kind: str):
        self.index_file = Path(c) / SHARD_INDEX_FILE
        try:
            index = layout.read_json(self.index_file, "checkpoint shard index", required=SHARD_INDEX_SCHEMA)
        except layout.LayoutError as e:
            raise CheckpointError(str(e)) from None
        if index["prodip_shards"] != SHARD_FORMAT:
            raise CheckpointError(f"{self.index_file}: shard format {index['prodip_shards']}, this prodip reads "
                                  f"{SHARD_FORMAT}")
        self.entries: dict = index[kind]
        self.names = list(self.entries)
        self.digests = recorded_digests(index, self.index_file)  # None: an index from before they were recorded
        self._verified: set[str] = set()  # files whose sha256 was checked (once, before their first tensor is read)
        self._files: dict[str, object] = {}
        self._stack = contextlib.ExitStack()
        try:
            for name in index["files"]:
                f = self._path(name)
                if not f.is_file():
                    raise CheckpointError(f"{f}: shard file not found (listed in {self.index_file})")
                if self.digests is not None:
                    check_size(f, self.digests[name], self.index_file)
                try:
                    self._files[name] = self._stack.enter_context(safe_open(str(f), framework="pt"))
                except (SafetensorError, OSError, ValueError) as e:
                    raise CheckpointError(unreadable_tensors(f, e)) from None
        except BaseException:
            self._stack.close()
            raise

    def _path(self, name: object) -> Path:
        """A file the index names: a plain file name in the checkpoint folder, nothing else."""
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise CheckpointError(f"{self.index_file}: {name!r} is not a shard file name")
        return self.index_file.parent / name

    def keys(self) -> list[str]:
        return list(self.names)

    def get_tensor(self, name: str) -> torch.Tensor:
        e = self.entries.get(name)
        where = f"{self.index_file} ({name})"
        if e is None:
            raise CheckpointError(f"{self.index_file}: lists no tensor {name}")
        try:
            shape, dtype, parts = e["shape"], STORED_DTYPES[e["dtype"]], e["parts"]
            if not parts or not all(isinstance(p, list) and len(p) == 3 for p in parts):
                raise ValueError("no parts")
            parts = sorted(parts, key=lambda p: p[1] if isinstance(p[1], int) else -1)
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{where}: damaged entry {e!r}") from None
        if parts[0][1] is None:  # whole, in one file (RNG states, step counts)
            t = self._part(parts[0][0], name)
            if t.dtype != dtype or (shape is not None and list(t.shape) != shape):
                raise CheckpointError(f"{self._path(parts[0][0])}: {name} is {t.dtype} {list(t.shape)}, "
                                      f"{self.index_file} says {dtype} {shape}")
            return t
        self._check_rows(name, shape, parts)  # headers only: nothing is allocated for a shape no file holds
        out = torch.empty(shape, dtype=dtype)
        for file, lo, hi in parts:
            t = self._part(file, name)
            if t.dtype != dtype:
                raise CheckpointError(f"{self._path(file)}: {name} is {t.dtype}, {self.index_file} says {dtype}")
            out[lo:hi] = t
        return out

    def _check_rows(self, name: str, shape: object, parts: list[list]) -> None:
        """The parts, in row order, tile dim 0 of `shape` exactly, each file's header holding its rows."""
        where = f"{self.index_file} ({name})"
        if not (isinstance(shape, list) and shape and all(type(n) is int and n >= 0 for n in shape)):
            raise CheckpointError(f"{where}: damaged shape {shape!r}")
        done = 0  # rows covered so far
        for file, lo, hi in parts:
            if not (type(lo) is int and type(hi) is int and lo == done and done < hi <= shape[0]):
                raise CheckpointError(f"{where}: rows {lo}..{hi} do not continue rows 0..{done} of {shape[0]}")
            try:
                got = list(self._handle(file, name).get_slice(name).get_shape())
            except (SafetensorError, OSError, ValueError) as err:
                raise CheckpointError(f"{self._path(file)}: cannot read {name} ({err})") from None
            if got != [hi - lo, *shape[1:]]:
                raise CheckpointError(f"{self._path(file)}: {name} is {got}, {self.index_file} says rows {lo}..{hi} "
                                      f"of {shape}")
            done = hi
        if done != shape[0]:
            raise CheckpointError(f"{where}: rows {done}..{shape[0]} are in no shard file")

    def _handle(self, file: str, name: str):  # noqa: ANN202 (safetensors' own handle type)
        f = self._files.get(file) if isinstance(file, str) else None
        if f is None:
            raise CheckpointError(f"{self.index_file}: {name} is in {file!r}, which the index does not list")
        return f

    def _part(self, file: str, name: str) -> torch.Tensor:
        f = self._handle(file, name)
        if self.digests is not None and file not in self._verified:  # before its first tensor is used
            check_digest(self._path(file), self.digests[file], self.index_file)
            self._verified.add(file)
        try:
            return f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self._path(file)}: cannot read {name} ({e})") from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def open_tensors(c: Path) -> Iterator:
    """A checkpoint's weights one at a time (`keys()`, `get_tensor(name)`), whichever form it is in:
    model.safetensors memory-mapped, or a sharded checkpoint's rows assembled per tensor."""
    c = Path(c)
    if is_sharded(c):
        with ShardedReader(c, "model") as r:
            yield r
        return
    try:
        handle = safe_open(str(c / MODEL_FILE), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(unreadable_tensors(c / MODEL_FILE, e)) from None
    with handle as f:
        yield f


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    state: dict
    tokenizer: Tokenizer

    def optimizer_and_rng(self, strict: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Optimizer moments and RNG states; `strict` (a resume): a missing file or RNG state is an error."""
        f = self.path / OPTIM_FILE
        if is_sharded(self.path):
            with ShardedReader(self.path, "optim") as r:
                f = r.index_file
                if not r.names and strict:
                    raise CheckpointError(f"{f}: optimizer state not found")
                t = {k: r.get_tensor(k) for k in r.names}
        elif not f.is_file():
            if strict:
                raise CheckpointError(f"{f}: optimizer state not found")
            return {}, {}
        else:
            try:
                t = load_file(str(f))
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(unreadable_tensors(f, e)) from None
        rng = {k[len(RNG_PREFIX):]: v for k, v in t.items() if k.startswith(RNG_PREFIX)}
        check_tensors_finite({k: v for k, v in t.items() if not k.startswith(RNG_PREFIX)}, f)
        if strict and CPU_RNG not in rng:
            raise CheckpointError(f"{f}: holds no RNG state ({RNG_PREFIX}{CPU_RNG})")
        return {k: v for k, v in t.items() if not k.startswith(RNG_PREFIX)}, rng


def read_state(c: Path, required: layout.Schema = STATE_SCHEMA) -> dict:
    """A checkpoint's state.json, checked: its format version, the keys in `required`, and its values
    (training.checkpoint.checkpoint_verify: the step against the folder's name, every counter finite and in range)."""
    try:
        state = layout.read_json(c / STATE_FILE, "checkpoint state", required=required, version=layout.STATE_FORMAT)
    except layout.LayoutError as e:
        raise CheckpointError(str(e)) from None
    return check_state(state, Path(c), Path(c) / STATE_FILE)


def read_config(c: Path) -> ModelConfig:
    """A checkpoint's config.json as a ModelConfig, read strictly (a file we wrote: every field present, of
    its exact type); CheckpointError naming the file and the field otherwise."""
    try:
        return strict_model_config(layout.read_json(c / CONFIG_FILE, "model config"), c / CONFIG_FILE)
    except layout.LayoutError as e:
        raise CheckpointError(str(e)) from None


def load(path: str | os.PathLike, step: int | None = None) -> Checkpoint:
    """Read a checkpoint (weights only through safetensors; nothing is unpickled). A bare folder of
    weights + config.json + tokenizer (no state.json) loads too: it is not resumable, but exportable."""
    c = resolve(path, step)
    cfg = read_config(c)
    # a run's checkpoint holds its state.json by construction; a bare folder elsewhere need not
    state = read_state(c) if (c / STATE_FILE).exists() or layout.is_checkpoint_dir(c) else {}
    if is_sharded(c):  # every rank's rows assembled into full tensors
        with ShardedReader(c, "model") as r:
            weights = {k: r.get_tensor(k) for k in r.names}
    elif not (c / MODEL_FILE).is_file():
        raise CheckpointError(f"{c / MODEL_FILE}: model weights not found")
    else:
        try:
            weights = load_file(str(c / MODEL_FILE))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(unreadable_tensors(c / MODEL_FILE, e)) from None
    check_tensors_finite(weights, c / (SHARD_INDEX_FILE if is_sharded(c) else MODEL_FILE))
    tok = Tokenizer.load(c / TOKENIZER_FILE)
    if tok.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{c}: tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}")
    if state.get("tokenizer_sha256") not in (None, tok.sha256):
        raise CheckpointError(f"{c}: tokenizer.model does not match the tokenizer the weights were trained with")
    with torch.device("meta"):  # the config's names and shapes, without allocating a model
        check_fits(Transformer(cfg), weights, c / (SHARD_INDEX_FILE if is_sharded(c) else MODEL_FILE))
    return Checkpoint(c, cfg, weights, state, tok)


def load_weights(model: Transformer, weights: dict[str, torch.Tensor]) -> None:
    """Load into `model` strictly (the tied head is the only key allowed to be absent)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed = {"output.weight"} if model.cfg.tie_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise CheckpointError(f"weights do not fit the model: missing {sorted(set(missing) - allowed)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]}")


def load_model(path: str | os.PathLike, step: int | None = None, device: str = "cpu") -> tuple[Transformer, Checkpoint]:
    """The trained model in eval mode (fp32) and its checkpoint record: what every later stage reads."""
    ck = load(path, step)
    model = Transformer(ck.config)
    load_weights(model, ck.weights)
    return model.to(device).eval(), ck

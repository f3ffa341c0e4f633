"""The one checkpoint format: safetensors for tensors, JSON for everything else; no pickle anywhere.

    RUN_DIR/checkpoints/step_0000100/
        model.safetensors   weights (tied output head stored once, as tok_embeddings.weight)
        optim.safetensors   optimizer moments keyed "<param name>/<moment>" + RNG states "rng/<name>"
        state.json          step, tokens, data position, scheduler, optimizer hyper-parameters, ...
        config.json         the ModelConfig
        tokenizer.model     the SentencePiece model the weights were trained with

A checkpoint is written into a hidden temporary folder, fsynced, and renamed into place: a folder
named step_* is complete by construction, and `latest()` never sees a partial save. Non-finite
weights are refused before anything is written.

Training saves through a CheckpointWriter: the tensors are finite-checked where they live (one small
host read), copied into reusable host buffers (pinned, with non-blocking copies, from a GPU), and
written by a background thread while training goes on. At most one write is in flight: the next save
waits for it first, and a write that failed raises its error there (or at `wait()`, before the run
ends). `asynchronous=False` writes in the caller's thread instead (--no-async-checkpoints, debugging).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Container
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from training import layout
from training.files import save_safetensors
from training.model import ModelConfig, Transformer
from training.tokenizer import Tokenizer

FORMAT_VERSION = 1
# the file names are layout's; these aliases are the names other modules have long imported from here
MODEL_FILE, OPTIM_FILE, STATE_FILE, CONFIG_FILE, TOKENIZER_FILE = (
    layout.MODEL_WEIGHTS, layout.OPTIMIZER, layout.STATE, layout.MODEL_CONFIG, layout.TOKENIZER)
STEP_PREFIX = layout.STEP_PREFIX
TMP_PREFIX = ".tmp-"
RNG_PREFIX = "rng/"
CPU_RNG = "torch_cpu"  # the RNG state every checkpoint holds (training.optim.rng_state)
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq", "step")  # what AdamW keeps per parameter


class CheckpointError(ValueError):
    pass


# what every state.json holds (checkpoint.save writes these); a resume needs the RESUME_ keys too
STATE_SCHEMA: layout.Schema = {"step": int, "tokenizer_sha256": str}
RESUME_STATE_SCHEMA: layout.Schema = {**STATE_SCHEMA, "tokens": int, "data": dict}


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def drop_tied(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights a checkpoint stores: the tied head dropped (safetensors stores no shared tensors)."""
    return {k: v for k, v in state_dict.items() if not (cfg.tie_embeddings and k == "output.weight")}


def weights_for_save(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Contiguous CPU fp32 tensors, the tied head dropped (CPU fp32 ones are not copied)."""
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in drop_tied(state_dict, cfg).items()}


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The floating-point tensors holding a NaN or inf, decided on their own device: one small host
    read per device, never a host-side scan of the state."""
    by_device: dict[torch.device, list[str]] = {}
    for k, v in tensors.items():
        if v.is_floating_point():
            by_device.setdefault(v.device, []).append(k)
    bad = []
    for names in by_device.values():
        flags = torch.stack([torch.isfinite(tensors[k]).all() for k in names]).tolist()
        bad += [k for k, ok in zip(names, flags, strict=True) if not ok]
    return bad


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    bad = nonfinite(tensors)
    if bad:
        raise CheckpointError(f"refusing to save {what}: {bad[0]} holds non-finite values")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())


def flatten_optimizer(optim_sd: dict, names: list[str]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """torch optimizer state_dict -> ({"name/moment": tensor}, JSON param groups with names).

    Accepts both index-keyed (plain `optimizer.state_dict()`, with `names` in parameter order) and
    name-keyed state (torch.distributed.checkpoint's full optimizer state dict)."""
    tensors = {}
    for key, st in optim_sd["state"].items():
        name = names[key] if isinstance(key, int) else key
        for moment, v in st.items():  # left on their device: the writer copies them (or write() does)
            tensors[f"{name}/{moment}"] = v.detach() if torch.is_tensor(v) else torch.tensor(v)
    groups = []
    for g in optim_sd["param_groups"]:
        g2 = {k: v for k, v in g.items() if k != "params"}
        g2["params"] = [names[p] if isinstance(p, int) else p for p in g["params"]]
        groups.append(g2)
    return tensors, groups


def unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict], names: list[str] | None) -> dict:
    """Inverse of flatten_optimizer; index-keyed when `names` (parameter order) is given."""
    index = {n: i for i, n in enumerate(names)} if names is not None else None
    state: dict = {}
    for k, v in tensors.items():
        name, moment = k.rsplit("/", 1)
        key = index[name] if index is not None else name
        state.setdefault(key, {})[moment] = v
    pgs = []
    for g in groups:
        g2 = dict(g)
        g2["params"] = [index[p] for p in g["params"]] if index is not None else list(g["params"])
        pgs.append(g2)
    return {"state": state, "param_groups": pgs}


def save(run_dir: Path, step: int, *, weights: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Tokenizer,
         optim_tensors: dict[str, torch.Tensor] | None = None, rng: dict[str, torch.Tensor] | None = None,
         state: dict | None = None, keep_last: int = 0, keep: Container[int] = ()) -> Path:
    """Atomically write checkpoint `step`; then prune to the newest `keep_last` (0 keeps all), never
    pruning the steps in `keep` (early stopping's best one). Non-finite tensors are refused first."""
    check_finite(weights, "weights")
    if optim_tensors:
        check_finite(optim_tensors, "optimizer state")
    return write(run_dir, step, weights=weights, cfg=cfg, tokenizer=tokenizer, optim_tensors=optim_tensors, rng=rng,
                 state=state, keep_last=keep_last, keep=keep)


def _host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}  # no copy for CPU tensors


def write(run_dir: Path, step: int, *, weights: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Tokenizer,
          optim_tensors: dict[str, torch.Tensor] | None = None, rng: dict[str, torch.Tensor] | None = None,
          state: dict | None = None, keep_last: int = 0, keep: Container[int] = ()) -> Path:
    """save() without the finite check (the caller has made it): the atomic write and the pruning."""
    ckpt_root = Path(run_dir) / layout.CHECKPOINTS
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}"
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_root.glob(TMP_PREFIX + "*"):  # left behind by a save that was killed mid-way
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        save_safetensors(_host(weights), tmp / MODEL_FILE,  # the user's umask, not safetensors' 0600
                         metadata={"format": "pt", "prodip_format": str(FORMAT_VERSION)})
        extra = _host(optim_tensors or {})
        extra.update(_host({RNG_PREFIX + k: v for k, v in (rng or {}).items()}))
        if extra:
            save_safetensors(extra, tmp / OPTIM_FILE)
        _write_json(tmp / STATE_FILE, {"prodip_format": FORMAT_VERSION, "step": step,
                                       "tokenizer_sha256": tokenizer.sha256, **(state or {})})
        _write_json(tmp / CONFIG_FILE, cfg.to_dict())
        tokenizer.save(tmp / TOKENIZER_FILE)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
            old = ckpt_root / f"{TMP_PREFIX}old-{step_dir_name(step)}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_root)
    except (OSError, SafetensorError) as e:  # e.g. a full disk: one clear line, older checkpoints untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {step} in {ckpt_root} ({e}); the previous checkpoints "
                              "are intact: free some space, then run the same command again to resume") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            if step_of(old) not in keep:
                remove(old)
    return final


class CheckpointWriter:
    """Checkpoints written off the training loop (see the module doc). One per run; rank 0's.

    `stall_s` and `write_s` hold, per save, the seconds the caller was blocked (check + copy; the
    whole write when synchronous) and the seconds the write itself took."""

    def __init__(self, *, asynchronous: bool = True):
        self.asynchronous = asynchronous
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # host copies, reused by every save (same shapes)
        self.stall_s: list[float] = []
        self.write_s: list[float] = []

    def save(self, run_dir: Path, step: int, *, weights: dict[str, torch.Tensor], cfg: ModelConfig,
             tokenizer: Tokenizer, optim_tensors: dict[str, torch.Tensor], rng: dict[str, torch.Tensor],
             state: dict, keep_last: int = 0, keep: Container[int] = (), fresh: bool = False,
             checked: bool = False) -> None:
        """Checkpoint `step` of the given tensors (on any device; weights are stored in fp32). Waits for
        the previous write first and raises its CheckpointError; refuses non-finite tensors before any
        copy. Returns once the tensors are copied: the caller may then change them. `fresh`: they are
        CPU copies nobody else holds (FSDP2's gathered state), written without another copy. `checked`:
        the caller has finite-checked them already (the trainer does, on the device, before gathering)."""
        self.wait()
        t0 = time.perf_counter()
        if not checked:
            check_finite(weights, "weights")
            check_finite(optim_tensors, "optimizer state")
        kw = dict(cfg=cfg, tokenizer=tokenizer, state=json.loads(json.dumps(state)), keep_last=keep_last, keep=keep)
        if not self.asynchronous:
            weights = {k: v.to(torch.float32) for k, v in weights.items()}
            self._write(None, run_dir, step, weights=weights, optim_tensors=optim_tensors, rng=rng, **kw)
            self.stall_s.append(time.perf_counter() - t0)
            return
        if fresh and all(v.device.type == "cpu" for v in (*weights.values(), *optim_tensors.values())):
            weights = {k: v.to(torch.float32) for k, v in weights.items()}  # no copy when already fp32
        else:
            weights = self._stage("model/", weights, torch.float32)
            optim_tensors = self._stage("optim/", optim_tensors)
        rng = {k: v.detach().to("cpu", copy=True) for k, v in rng.items()}
        copied = None
        if any(v.is_cuda for v in (*weights.values(), *optim_tensors.values())):
            copied = torch.cuda.Event()  # the non-blocking copies are queued before it on this stream
            copied.record()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._inflight = self._pool.submit(self._write, copied, run_dir, step, weights=weights,
                                           optim_tensors=optim_tensors, rng=rng, **kw)
        self.stall_s.append(time.perf_counter() - t0)

    def _stage(self, prefix: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None
               ) -> dict[str, torch.Tensor]:
        """Host copies of `tensors` in this writer's buffers: pinned and non-blocking from a GPU."""
        out = {}
        for k, v in tensors.items():
            v = v.detach()
            want = dtype if dtype is not None and v.is_floating_point() else v.dtype
            buf = self._buffers.get(prefix + k)
            if buf is None or buf.shape != v.shape or buf.dtype != want:
                buf = torch.empty(v.shape, dtype=want, pin_memory=v.is_cuda)
                self._buffers[prefix + k] = buf
            buf.copy_(v, non_blocking=v.is_cuda)
            out[k] = buf
        return out

    def _write(self, copied: torch.cuda.Event | None, run_dir: Path, step: int, **kw) -> Path:
        if copied is not None:
            copied.synchronize()
        t0 = time.perf_counter()
        path = write(run_dir, step, **kw)
        self.write_s.append(time.perf_counter() - t0)
        return path

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is on disk; its path, or its error raised here, once."""
        inflight, self._inflight = self._inflight, None
        return inflight.result() if inflight is not None else None

    def close(self) -> None:
        """Wait for the last write (its error is raised) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def step_of(path: Path) -> int | None:
    """N of a folder named step_N (None for any other name)."""
    digits = path.name[len(STEP_PREFIX):]
    return int(digits) if path.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Every step_* folder, oldest first. Temporary folders are never listed; a step_* folder is
    complete by construction (renamed into place whole), so one that has lost a file since is listed
    too, and reading it fails naming the file, rather than a resume silently falling back to an older one."""
    root = Path(run_dir) / layout.CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def remove(path: Path) -> None:
    """Delete a checkpoint: renamed to a temporary name first (atomic), so a kill mid-delete never
    leaves a half-deleted step_* folder for `latest()` to find; a later save clears the rest."""
    doomed = path.with_name(f"{TMP_PREFIX}del-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def latest(run_dir: Path) -> Path | None:
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


def resolve(path: str | os.PathLike, step: int | None = None) -> Path:
    """A checkpoint folder from a RUN_DIR (latest, or `step`) or a checkpoint folder itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"not found: {p}")
    if (p / MODEL_FILE).is_file() and (p / CONFIG_FILE).is_file():
        return p
    if step is not None:
        c = p / layout.CHECKPOINTS / step_dir_name(step)
        if not c.is_dir():
            raise CheckpointError(f"no checkpoint for step {step} in {p}")
        return c
    c = latest(p)
    if c is None:
        raise CheckpointError(f"{p} holds no complete checkpoint (expected a run folder or a checkpoint folder)")
    return c


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
    for f in (c / MODEL_FILE, c / OPTIM_FILE):
        if f.name == OPTIM_FILE and not f.is_file():
            continue
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(unreadable_tensors(f, e)) from None


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
        if not f.is_file():
            if strict:
                raise CheckpointError(f"{f}: optimizer state not found")
            return {}, {}
        try:
            t = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(unreadable_tensors(f, e)) from None
        rng = {k[len(RNG_PREFIX):]: v for k, v in t.items() if k.startswith(RNG_PREFIX)}
        if strict and CPU_RNG not in rng:
            raise CheckpointError(f"{f}: holds no RNG state ({RNG_PREFIX}{CPU_RNG})")
        return {k: v for k, v in t.items() if not k.startswith(RNG_PREFIX)}, rng


def read_state(c: Path, required: layout.Schema = STATE_SCHEMA) -> dict:
    """A checkpoint's state.json, checked: its format version and the keys in `required`."""
    try:
        return layout.read_json(c / STATE_FILE, "checkpoint state", required=required, version=layout.STATE_FORMAT)
    except layout.LayoutError as e:
        raise CheckpointError(str(e)) from None


def read_config(c: Path) -> ModelConfig:
    """A checkpoint's config.json as a ModelConfig; CheckpointError naming the file otherwise."""
    try:
        return ModelConfig.from_dict(layout.read_json(c / CONFIG_FILE, "model config"))
    except layout.LayoutError as e:
        raise CheckpointError(str(e)) from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{c / CONFIG_FILE}: not a valid model config ({e})") from None


def load(path: str | os.PathLike, step: int | None = None) -> Checkpoint:
    """Read a checkpoint (weights only through safetensors; nothing is unpickled). A bare folder of
    weights + config.json + tokenizer (no state.json) loads too: it is not resumable, but exportable."""
    c = resolve(path, step)
    cfg = read_config(c)
    # a run's checkpoint holds its state.json by construction; a bare folder elsewhere need not
    state = read_state(c) if (c / STATE_FILE).exists() or layout.is_checkpoint_dir(c) else {}
    if not (c / MODEL_FILE).is_file():
        raise CheckpointError(f"{c / MODEL_FILE}: model weights not found")
    try:
        weights = load_file(str(c / MODEL_FILE))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(unreadable_tensors(c / MODEL_FILE, e)) from None
    tok = Tokenizer.load(c / TOKENIZER_FILE)
    if tok.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{c}: tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}")
    if state.get("tokenizer_sha256") not in (None, tok.sha256):
        raise CheckpointError(f"{c}: tokenizer.model does not match the tokenizer the weights were trained with")
    return Checkpoint(c, cfg, weights, state, tok)


def check_fits(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Every weight of `model` in `weights` with its shape (the tied head may be absent), before loading."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        expected.pop("output.weight", None)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected) - {"output.weight"})
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{where}: weights do not fit the model: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}, wrong shape {wrong[:3]}")


def check_optimizer_fits(params: list[tuple[str, torch.nn.Parameter]], tensors: dict[str, torch.Tensor],
                         rng: dict[str, torch.Tensor], where: Path) -> None:
    """AdamW moments (exp_avg, exp_avg_sq of each parameter's shape, and step) for every trainable
    parameter that has any, and a CPU RNG state torch accepts: anything less would resume, but not exactly."""
    for name, p in params:
        present = [m for m in ADAM_MOMENTS if f"{name}/{m}" in tensors]
        if not present:
            continue  # AdamW makes a parameter's state at its first update: none yet is exact too
        for moment in ADAM_MOMENTS:
            t = tensors.get(f"{name}/{moment}")
            if t is None:
                raise CheckpointError(f"{where}: no optimizer state {name}/{moment}")
            if moment != "step" and tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{where}: optimizer state {name}/{moment} has shape {tuple(t.shape)}, "
                                      f"the parameter {tuple(p.shape)}")
    cpu = rng.get(CPU_RNG)
    if cpu is None or cpu.dtype != torch.uint8 or cpu.numel() != torch.get_rng_state().numel():
        raise CheckpointError(f"{where}: damaged RNG state {RNG_PREFIX}{CPU_RNG}")


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

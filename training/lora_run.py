"""An adapter run: training/sft.py --lora-rank R through the one training loop (training.trainer).

    LoRATrainer        the Trainer with the base loaded from --init, adapters added (training.lora), the
                       adapter gates (training.gates.adapters) and adapter-only checkpoints
    AdapterCheckpointer  the loop's Checkpointer, writing through the same CheckpointWriter (atomic
                       step_* folders, keep-N, state.json) but only the adapter tensors and their AdamW
                       moments: a few MB however large the base
    load_adapted       base + adapter of an adapter run (or checkpoint), for the held-out loss, export, serving

An adapter checkpoint's state.json holds "lora": {"spec": {rank, alpha, dropout, targets}, "base": {"path",
"sha256"}}: the base checkpoint by path and the sha256 of its model.safetensors. A resume, an export or a
server whose base has changed since (retrained, overwritten) is refused, naming the file.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from training import checkpoint as ckpt
from training import distributed as D
from training import optim
from training.files import sha256_file
from training.gates.adapters import ADAPTER_PREFLIGHT
from training.loop.checkpointer import Checkpointer, local_state
from training.loop.ranks import TrainError
from training.loop.step import ModelViews
from training.lora import LoRAError, LoRASpec, adapter_state, add_adapters
from training.model import ModelConfig, Transformer
from training.tokenizer import Tokenizer
from training.trainer import Trainer

STATE_KEY = "lora"  # the checkpoint state.json key holding the spec and the base


def describe_base(init: str | Path) -> dict:
    """{"path", "sha256"} of the --init checkpoint's weights (one model.safetensors: not a sharded one)."""
    c = ckpt.resolve(init)
    f = c / ckpt.MODEL_FILE
    if ckpt.is_sharded(c) or not f.is_file():
        raise LoRAError(f"--init {init}: an adapter needs a base whose weights are one {ckpt.MODEL_FILE} ({f} not found)")
    return {"path": str(c.resolve()), "sha256": sha256_file(f)}


def check_base(lora: dict, where: Path) -> Path:
    """The base an adapter names, unchanged since it was trained (sha256 of its weights); its folder."""
    base = lora.get("base") if isinstance(lora, dict) else None
    if not isinstance(base, dict) or not {"path", "sha256"} <= set(base):
        raise ckpt.CheckpointError(f"{where}: no base recorded under '{STATE_KEY}' (not an adapter checkpoint?)")
    f = Path(base["path"]) / ckpt.MODEL_FILE
    if not f.is_file():
        raise ckpt.CheckpointError(f"{where}: its base {f} is not there any more")
    if sha256_file(f) != base["sha256"]:
        raise ckpt.CheckpointError(f"{where}: its base {f} has changed since the adapter was trained "
                                   f"(sha256 {base['sha256'][:12]}... recorded); the adapter fits only that base")
    return Path(base["path"])


def check_fits(adapter: Path, base: Path) -> None:
    """The adapter checkpoint's model config and tokenizer are its base's: refused naming both otherwise."""
    ours, theirs = ckpt.read_config(adapter).to_dict(), ckpt.read_config(base).to_dict()
    if ours != theirs:
        diff = ", ".join(f"{k} {v} vs {theirs.get(k)}" for k, v in ours.items() if theirs.get(k) != v)
        raise ckpt.CheckpointError(f"the adapter {adapter} was made for another model than its base {base}: {diff}")
    a, b = (Tokenizer.load(p / ckpt.TOKENIZER_FILE).sha256 for p in (adapter, base))
    if a != b:
        raise ckpt.CheckpointError(f"the adapter {adapter} and its base {base} have different tokenizers "
                                   f"(sha256 {a[:12]}... vs {b[:12]}...)")


def adapted_model(cfg: ModelConfig, *, base: Path, spec: LoRASpec) -> Transformer:
    """The base's weights (fp32), every parameter frozen, adapters added: what an adapter run trains."""
    model = Transformer(cfg)
    ckpt.load_weights(model, ckpt.load(base).weights)
    add_adapters(model, spec)
    return model


def read_adapter(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An adapter checkpoint's tensors, checked against `model`'s adapters (names, shapes, floating point)."""
    f = path / ckpt.MODEL_FILE
    try:
        tensors = load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise ckpt.CheckpointError(ckpt.unreadable_tensors(f, e)) from None
    want = {k: tuple(v.shape) for k, v in adapter_state(model).items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if want != got or any(not v.dtype.is_floating_point for v in tensors.values()):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = [k for k in want if k in got and got[k] != want[k]]
        raise ckpt.CheckpointError(f"{f}: the adapter does not fit this model and --lora-* settings: missing "
                                   f"{missing[:3]}, unexpected {extra[:3]}, wrong shape {wrong[:3]}")
    return tensors


def load_adapted(path: str | Path, step: int | None = None, device: str = "cpu") -> tuple[Transformer, dict]:
    """Base + adapter of an adapter run or checkpoint, in eval mode; and its state.json."""
    c = ckpt.resolve(path, step)
    state = ckpt.read_state(c)
    lora = state.get(STATE_KEY)
    base = check_base(lora, c / ckpt.STATE_FILE)
    check_fits(c, base)
    model = adapted_model(ckpt.read_config(c), base=base, spec=LoRASpec.from_dict(lora.get("spec", {})))
    weights = read_adapter(c, model)
    model.load_state_dict(weights, strict=False)
    return model.to(device).eval(), state


def is_adapter_run(path: str | Path) -> bool:
    """Whether a run folder's (or checkpoint's) newest checkpoint is an adapter checkpoint."""
    try:
        c = ckpt.resolve(path)
        return isinstance(ckpt.read_state(c).get(STATE_KEY), dict)
    except (ckpt.CheckpointError, OSError, ValueError):
        return False


class AdapterRecord:
    """The registered state.json component: the spec and the base, checked again on resume."""

    def __init__(self, spec: LoRASpec, base: dict):
        self.spec, self.base = spec, base

    def state_dict(self) -> dict:
        return {"spec": self.spec.to_dict(), "base": self.base}

    def load_state_dict(self, state: dict) -> None:
        pass  # find_latest checked it before anything was read


class AdapterCheckpointer(Checkpointer):
    """Adapter-only checkpoints through the loop's writer: single process (the sft.py boundary refuses torchrun)."""

    def __init__(self, *args: Any, record: AdapterRecord, **kw: Any):
        super().__init__(*args, **kw)
        self.record = record
        self.register(STATE_KEY, record, "adapter description")

    def find_latest(self, tokenizer_sha: str, total_steps: int) -> Path | None:
        latest = super().find_latest(tokenizer_sha, total_steps)
        if latest is None:
            return None
        lora = ckpt.read_state(latest).get(STATE_KEY)
        if not isinstance(lora, dict):
            raise TrainError(f"cannot resume {latest} with --lora-rank: it is a full fine-tuning checkpoint; "
                             "use another --out")
        check_base(lora, latest / ckpt.STATE_FILE)
        if lora.get("base", {}).get("sha256") != self.record.base["sha256"]:
            raise TrainError(f"cannot resume {latest}: it adapts the base {lora['base'].get('path')}, not --init "
                             f"{self.record.base['path']}; use another --out")
        if lora.get("spec") != self.record.spec.to_dict():
            raise TrainError(f"cannot resume {latest} exactly: it was trained with the adapter {lora.get('spec')} "
                             f"(this command: {self.record.spec.to_dict()}); repeat its --lora-* flags or use another --out")
        return latest

    def init_from(self, model: torch.nn.Module, tokenizer_sha: str, path: str | Path = "") -> Path:
        """--init's weights are in the model already (adapted_model); only the tokenizer is checked here."""
        init = Path(self.record.base["path"])
        if Tokenizer.load(init / ckpt.TOKENIZER_FILE).sha256 != tokenizer_sha:
            raise TrainError(f"--init {self.cfg.init} was trained with another tokenizer than this data's")
        return init

    def _read_tensors(self, path: Path, state: dict, views: ModelViews) -> tuple[dict, dict | None, dict, str | None]:
        if ckpt.read_config(path).to_dict() != views.model.cfg.to_dict():
            raise ckpt.CheckpointError(f"cannot resume {path}: its {ckpt.CONFIG_FILE} differs from the run's model config")
        weights = read_adapter(path, views.model)
        rec = ckpt.Checkpoint(path, views.model.cfg, weights, state, Tokenizer.load(path / ckpt.TOKENIZER_FILE))
        return (weights, *self._read_optimizer(rec, state, views))

    def reserve(self, views: ModelViews) -> None:
        tensors, _ = ckpt.flatten_optimizer(optim_state(views), [])
        reserve = getattr(self.writer, "reserve", None)
        if reserve is not None:
            reserve(adapter_state(views.model), tensors)

    def save(self, step: int, views: ModelViews, tokenizer: Tokenizer) -> None:
        """The adapter tensors and their optimizer state, atomically, through the run's CheckpointWriter."""
        self.finish()
        t0 = time.perf_counter()
        bad = ckpt.nonfinite(local_state(views))
        if bad:
            raise ckpt.CheckpointError(f"refusing to save step {step}: {bad[0]} holds non-finite values")
        tensors, groups = ckpt.flatten_optimizer(optim_state(views), [])
        self.writer.save(self.out, step, weights=adapter_state(views.model), cfg=views.model.cfg, tokenizer=tokenizer,
                         optim_tensors=tensors, rng=optim.rng_state(self.device), state=self._state(groups),
                         keep_last=self.cfg.keep_last, keep=self.keep(), checked=True)
        self.saved_step = step
        self.landing = {"step": step, "stall_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        if not self.cfg.async_checkpoints:
            self._log_landed(0.0)


def optim_state(views: ModelViews) -> dict:
    return D.full_optimizer_state(views.wrapped, views.optimizer, rank0_only=False)


class LoRATrainer(Trainer):
    """The Trainer of an adapter run: `spec` on the --init base (cfg.init), base frozen."""

    gate_registry = ADAPTER_PREFLIGHT

    def __init__(self, cfg: Any, data_factory: Any, *, spec: LoRASpec, kind: str, force: bool = False):
        self.spec, self.base = spec, describe_base(cfg.init)
        build = functools.partial(adapted_model, base=Path(self.base["path"]), spec=spec)
        super().__init__(cfg, data_factory, kind=kind, force=force, model_class=build)  # type: ignore[arg-type]
        # the checkpointer the Trainer's setup builds, knowing the adapter before it looks for a checkpoint
        self.checkpointer_class = functools.partial(  # type: ignore[assignment]
            AdapterCheckpointer, record=AdapterRecord(spec, self.base))

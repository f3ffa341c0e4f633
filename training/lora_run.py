"""An adapter run: training/sft.py --lora-rank R through the one training loop (training.trainer).

    LoRATrainer        the Trainer with the base loaded from --init, adapters added (training.model.lora), the
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

from training import distributed as D
from training import optim
from training.checkpoint import checkpoint_io as ckpt
from training.checkpoint.adapter_io import (
    STATE_KEY,
    adapted_model,
    check_base,
    describe_base,
    read_adapter,
)
from training.gates.adapters import ADAPTER_PREFLIGHT
from training.loop.checkpointer import Checkpointer, local_state
from training.loop.rank_agreement import TrainError
from training.loop.step import ModelViews
from training.model.lora import LoRASpec, adapter_state
from training.text.tokenizer import Tokenizer
from training.trainer import Trainer


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

    def __init__(self, *args: Any, record: AdapterRecord, parts: tuple = (), **kw: Any):
        super().__init__(*args, parts=((STATE_KEY, record, "adapter description"), *parts), **kw)
        self.record = record

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

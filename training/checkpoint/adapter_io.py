"""An adapter checkpoint as any stage reads it: the base it names (path + sha256, checked), the adapter's
tensors checked against the model's adapters, base + adapter loaded as one model. The writing side is
training.lora_run (the adapter run's checkpointer)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from training.checkpoint import checkpoint_io as ckpt
from training.model.decoder import ModelConfig, Transformer
from training.model.lora import LoRAError, LoRASpec, adapter_state, add_adapters
from training.runfiles.file_ops import sha256_file
from training.text.tokenizer import Tokenizer

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

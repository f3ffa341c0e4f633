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

The format (names, schema, listing) is training.checkpoint_format; writing (the atomic write, keep-N,
the background CheckpointWriter) is training.checkpoint_write; this module reads and verifies, and is
the one name every stage imports: both halves' public names are re-exported here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from training import layout
from training.checkpoint_format import (
    ADAM_MOMENTS,
    CONFIG_FILE,
    CPU_RNG,
    FORMAT_VERSION,
    MODEL_FILE,
    OPTIM_FILE,
    RESUME_STATE_SCHEMA,
    RNG_PREFIX,
    STATE_FILE,
    STATE_SCHEMA,
    STEP_PREFIX,
    TMP_PREFIX,
    TOKENIZER_FILE,
    CheckpointError,
    flatten_optimizer,
    latest,
    list_checkpoints,
    remove,
    resolve,
    step_dir_name,
    step_of,
    unflatten_optimizer,
)
from training.checkpoint_write import (
    CheckpointWriter,
    check_finite,
    drop_tied,
    nonfinite,
    save,
    weights_for_save,
    write,
)
from training.model import ModelConfig, Transformer
from training.tokenizer import Tokenizer

__all__ = [
    # the format (training.checkpoint_format)
    "ADAM_MOMENTS", "CONFIG_FILE", "CPU_RNG", "FORMAT_VERSION", "MODEL_FILE", "OPTIM_FILE", "RESUME_STATE_SCHEMA",
    "RNG_PREFIX", "STATE_FILE", "STATE_SCHEMA", "STEP_PREFIX", "TMP_PREFIX", "TOKENIZER_FILE", "CheckpointError",
    "flatten_optimizer", "latest", "list_checkpoints", "remove", "resolve", "step_dir_name", "step_of",
    "unflatten_optimizer",
    # writing (training.checkpoint_write)
    "CheckpointWriter", "check_finite", "drop_tied", "nonfinite", "save", "weights_for_save", "write",
    # reading (here)
    "PICKLE_HEADS", "Checkpoint", "check_fits", "check_optimizer_fits", "check_readable", "load", "load_model",
    "load_weights", "read_config", "read_state", "unreadable_tensors",
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
    with torch.device("meta"):  # the config's names and shapes, without allocating a model
        check_fits(Transformer(cfg), weights, c / MODEL_FILE)
    return Checkpoint(c, cfg, weights, state, tok)


def check_fits(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Every weight of `model` in `weights` with its shape and a floating-point dtype (the tied head may be
    absent), before loading."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        expected.pop("output.weight", None)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected) - {"output.weight"})
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{where}: weights do not fit the model: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}, wrong shape {wrong[:3]}")
    # a header that says I32 over a float payload of the same size reads without an error: only the dtype tells
    not_float = sorted(k for k, v in weights.items() if not v.dtype.is_floating_point)
    if not_float:
        raise CheckpointError(f"{where}: weights are not floating point: {not_float[0]} is {weights[not_float[0]].dtype}")


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
            if not t.dtype.is_floating_point:  # AdamW keeps its moments and its step count as floats
                raise CheckpointError(f"{where}: optimizer state {name}/{moment} is {t.dtype}, not floating point")
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

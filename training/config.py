"""TrainConfig: every training setting, from a preset, a TOML file and CLI overrides (in that order).

The command-line flags of every training CLI (training/train.py, training/sft.py) are made here from
TrainConfig's fields, so each flag has one spelling and one default.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Container
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from training.model import ModelConfig, preset


class ConfigError(ValueError):
    pass


@dataclass
class TrainConfig:
    data: str = ""
    out: str = ""
    preset: str = "small"
    max_steps: int = 0  # 0: derived from max_tokens
    max_tokens: int = 0
    stop_at: int = 0  # stop (with a checkpoint) after this step, as if interrupted; resume later
    batch_size: int = 8  # micro-batch per process
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | wsd | constant
    decay_frac: float = 0.2  # WSD: final fraction of steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    device: str = "auto"
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere
    compile: bool = False
    fsdp: bool = False
    activation_checkpointing: bool = False
    seed: int = 1337
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 200
    keep_last: int = 3
    log_every: int = 10
    gpu_hourly_usd: float = 0.0
    on_nonfinite: str = "stop"  # stop | skip
    max_nonfinite_skips: int = 5
    spike_zscore: float = 6.0
    spike_window: int = 50
    on_spike: str = "warn"  # warn | skip: a loss spike (z > spike_zscore) also drops that batch's update
    grad_flow_every: int = 100
    skip_gates: list[str] = field(default_factory=list)
    init: str = ""  # start from this checkpoint's weights (fine-tuning)
    model: dict = field(default_factory=dict)  # overrides of the preset's ModelConfig

    def model_config(self, vocab_size: int) -> ModelConfig:
        over = dict(self.model)
        over["vocab_size"] = vocab_size
        over.setdefault("max_seq_len", max(self.seq_len, preset(self.preset).max_seq_len))
        try:
            return preset(self.preset, **over)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None

    def validate(self) -> TrainConfig:
        if self.schedule not in ("cosine", "wsd", "constant"):
            raise ConfigError(f"schedule must be cosine, wsd or constant, not {self.schedule!r}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"on_nonfinite must be stop or skip, not {self.on_nonfinite!r}")
        if self.on_spike not in ("warn", "skip"):
            raise ConfigError(f"on_spike must be warn or skip, not {self.on_spike!r}")
        for name in ("batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.max_steps <= 0 and self.max_tokens <= 0:
            raise ConfigError("set --max-steps or --max-tokens")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def load_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: invalid TOML ({e})") from None
    out = dict(raw.get("train", {}))
    if "model" in raw:
        out["model"] = dict(raw["model"])
    known = {f.name for f in fields(TrainConfig)}
    unknown = set(out) - known
    if unknown:
        raise ConfigError(f"{p}: unknown keys {sorted(unknown)}")
    return out


# ---------------------------------------------------------------------------------------------- CLI
NOT_FLAGS = ("model", "skip_gates")  # set through --set KEY=VALUE and --skip-gate NAME


def add_train_flags(p: argparse.ArgumentParser, exclude: Container[str] = ()) -> argparse.ArgumentParser:
    """One flag per TrainConfig field (--max-steps, ...; booleans as --x/--no-x), plus --config, --skip-gate,
    --set, --force and --debug. `exclude`: fields the caller declares its own way (SFT's --data, --init).
    Every default is None, so config_from_args can tell a flag given from one left out."""
    p.add_argument("--config", help="TOML file with [train] and [model] tables; CLI flags override it")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if f.name in NOT_FLAGS or f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument(flag, type=type(default), default=None, help=f"(default: {default})")
    p.add_argument("--skip-gate", action="append", default=None, metavar="NAME",
                   help="skip a pre-flight gate by name (emergencies only; recorded loudly in gates.json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. --set n_layers=4 (repeatable)")
    p.add_argument("--force", action="store_true", help="start over in an out dir that holds another run")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed flags: the preset's defaults < --config TOML < flags."""
    merged: dict = load_toml(args.config) if args.config else {}
    for f in fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name not in NOT_FLAGS:
            merged[f.name] = v
    if args.skip_gate:
        merged["skip_gates"] = list(merged.get("skip_gates", [])) + args.skip_gate
    model = dict(merged.get("model", {}))
    for kv in args.set:
        k, _, v = kv.partition("=")
        if not _:
            raise ConfigError(f"--set expects KEY=VALUE, got {kv!r}")
        try:
            model[k] = json.loads(v) if v[:1] in "0123456789-[{tf" and v not in ("t", "f") else v
        except json.JSONDecodeError:
            raise ConfigError(f"--set {kv}: {v!r} is not a valid value") from None
    merged["model"] = model
    cfg = TrainConfig(**merged)
    if not cfg.data:
        raise ConfigError("--data is required (a folder written by `python -m training.prepare`)")
    if not cfg.out:
        raise ConfigError("--out is required (the run folder)")
    return cfg.validate()

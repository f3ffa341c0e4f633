"""TrainConfig: every training setting, from a preset, a TOML file, flags and `--set` (in that order).

    preset's [train] (training/presets/NAME.toml) < --config FILE.toml < flags < --set KEY=VALUE

Every value passes through one schema, TrainConfig's and ModelConfig's annotated field types
(training.runfiles.schema): a flag is checked by argparse with `flag(T)`, a TOML key and a `--set` value by
`check`/`parse`, and an error names the flag, key or file and the value. Unknown keys and tables
are refused with the nearest valid name. The command-line flags of every training CLI
(training/train.py, training/sft.py) are made here from TrainConfig's fields, so each flag has one
spelling, one type and one default. The format is documented in docs/config.md.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Container
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import AfterValidator, Field

from training.gates.gate_names import PREFLIGHT_NAMES, is_known_gate
from training.model.decoder import ModelConfig, field_types, model_table, preset, preset_names, preset_tables
from training.runfiles.file_ops import Input, check_apart
from training.runfiles.schema import (
    URL_SCHEME,
    ConfigError,
    LocalPath,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    Probability,
    RunLocation,
    SchemaError,
    Seed,
    check,
    flag,
    parse,
    read_toml,
    suggest,
    toml_tables,
    unknown_name,
)
from training.store.urls import RemoteError, is_url, parse_url

MODEL_ERROR = "model config"  # how ModelConfig's own errors begin


# ----------------------------------------------------------------------------------- value types
def _known_preset(name: str) -> str:
    if name not in preset_names():
        raise unknown_name("preset", name, preset_names())
    return name


DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _device(name: str) -> str:
    if not DEVICE.fullmatch(name):
        raise ValueError(f"unknown device {name!r}; choose auto, cpu, cuda, cuda:N or mps")
    return name


def _known_gate(name: str) -> str:
    """A pre-flight gate (`gradient_flow`), a group of them (`data`) or one result (`data.no_repeats`)."""
    if not is_known_gate(name):
        raise unknown_name("gate", name, PREFLIGHT_NAMES)
    return name


PresetName = Annotated[str, AfterValidator(_known_preset)]
Device = Annotated[str, AfterValidator(_device)]
GateName = Annotated[str, AfterValidator(_known_gate)]
Schedule = Literal["cosine", "wsd", "constant"]
Dtype = Literal["auto", "fp32", "bf16"]  # what training.loop.step.autocast_for knows (no fp16 loss scaling)
# Sizes and counts: bounded so that a typo (10**30) is an error here, not an overflow in torch.
MAX_SIZE = 2**24  # batch, accumulation, sequence length, validation batches
MAX_COUNT = 2**62  # steps and tokens: fits int64 with room for arithmetic
Size = Annotated[int, Field(gt=0, le=MAX_SIZE)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Every = Annotated[int, Field(gt=0, le=MAX_COUNT)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]  # AdamW requires 0 <= beta < 1


@dataclass
class TrainConfig:
    data: RunLocation = ""  # a local folder, or a store URL pulled once into a local cache (training.store.remote_run)
    out: RunLocation = ""  # a local folder, or a store URL mirrored from a local cache (training.mirror.run_mirror)
    preset: PresetName = "small"
    max_steps: Count = 0
    max_tokens: Count = 0
    stop_at: Count = 0
    batch_size: Size = 8
    grad_accum: Size = 1
    seq_len: Size = 256
    lr: PositiveFloat = 3e-3
    min_lr_ratio: Probability = 0.1
    warmup_steps: Count = 20
    schedule: Schedule = "cosine"
    decay_frac: Probability = 0.2
    weight_decay: NonNegFloat = 0.1
    beta1: Beta = 0.9
    beta2: Beta = 0.95
    grad_clip: NonNegFloat = 1.0
    device: Device = "auto"
    dtype: Dtype = "auto"
    compile: bool = False
    fsdp: bool = False
    fsdp_reshard_after_forward: bool = True
    fsdp_sharded_checkpoints: bool = True
    activation_checkpointing: bool = False
    seed: Seed = 1337
    eval_every: Count = 100
    eval_batches: Size = 8
    save_every: Count = 200
    keep_last: Count = 3
    async_checkpoints: bool = True
    log_every: Every = 10
    gpu_hourly_usd: NonNegFloat = 0.0
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_nonfinite_skips: Count = 5
    spike_zscore: PositiveFloat = 6.0
    spike_window: Size = 50
    on_spike: Literal["warn", "skip"] = "warn"
    grad_flow_every: Count = 100
    skip_gates: list[GateName] = field(default_factory=list)
    init: RunLocation = ""  # a run folder or checkpoint, or a run at a store URL (pulled: training.store.remote_data)
    init_from: LocalPath = ""  # a Hugging Face model folder (or hub id): training.model.hf_import
    reset_optimizer: bool = False
    early_stop_patience: NonNegInt = 0
    log_to: Literal["", "tensorboard"] = ""
    fused_optimizer: Literal["auto", "on", "off"] = "auto"
    cache: LocalPath = ""  # a URL --out's local copy (default: training.store.remote_run.cache_dir)
    allow_local_only: bool = False
    model: dict[str, Any] = field(default_factory=dict)  # overrides of the preset's ModelConfig

    def __post_init__(self) -> None:
        # Code that builds a TrainConfig directly gets the same checks as a flag or a TOML key.
        for name, type_ in field_types(TrainConfig).items():
            setattr(self, name, check(type_, getattr(self, name), f"train config {name}"))

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The model of this run over a tokenizer of `vocab_size` pieces. The vocabulary is the data's:
        a [model] vocab_size / --set vocab_size that differs is refused by name, never replaced."""
        over = dict(self.model)
        if over.get("vocab_size", vocab_size) != vocab_size:
            raise ConfigError(f"vocab_size = {over['vocab_size']} ([model] or --set): the data's tokenizer has "
                              f"{vocab_size} pieces and the model's vocabulary is the tokenizer's; drop the setting")
        over["vocab_size"] = vocab_size
        over.setdefault("max_seq_len", max(self.seq_len, preset(self.preset).max_seq_len))
        try:
            return preset(self.preset, **over)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None

    def validate(self) -> TrainConfig:
        """The checks across fields, and the model built on paper: all before anything is written."""
        if self.max_steps <= 0 and self.max_tokens <= 0:
            raise ConfigError("set --max-steps or --max-tokens")
        if (self.cache or self.allow_local_only) and not URL_SCHEME.match(self.out):
            flag = "--cache" if self.cache else "--allow-local-only"
            raise ConfigError(f"{flag} only applies when --out is a URL (s3://BUCKET/PREFIX/RUN), not {self.out!r}")
        self.check_places()
        if self.init_from and self.init:
            raise ConfigError(f"--init-from {self.init_from} and --init {self.init}: give one starting point")
        if self.init_from and self.model:
            raise ConfigError(f"--init-from {self.init_from}: the model's shape is its config.json's; drop the "
                              f"[model] / --set keys {sorted(self.model)}")
        # on paper with the given vocab_size (or the preset's): model_config(data's) checks it later
        mc = self.model_config(self.model.get("vocab_size", preset(self.preset).vocab_size))
        if self.seq_len > mc.max_seq_len:
            raise ConfigError(f"--seq-len {self.seq_len} exceeds the model's max_seq_len {mc.max_seq_len}")
        return self

    def check_places(self) -> None:
        """Store URLs parsed by the one URL type (training.store.urls: no empty, `.` or `..` segment), and the run
        folder (and a URL run's --cache) apart from everything the run reads (training.runfiles.file_ops.check_apart)."""
        try:
            for flag_, value in (("--out", self.out), ("--data", self.data), ("--init", self.init)):
                if is_url(value):
                    parse_url(value, flag_)
        except RemoteError as e:
            raise ConfigError(str(e)) from None
        inputs = [Input("--data", self.data), Input("--init", self.init), Input("--init-from", self.init_from)]
        check_apart("--out", self.out, inputs, ConfigError)
        check_apart("--cache", self.cache, inputs, ConfigError)

    def to_dict(self) -> dict:
        return asdict(self)


# What each setting does: the flags' --help and docs/config.md say the same.
HELP: dict[str, str] = {
    "data": "the data folder written by `python -m training.prepare`",
    "out": "the run folder (the same command again resumes it)",
    "preset": "model shape and recipe: training/presets/NAME.toml (its [train] table changes some defaults shown here)",
    "max_steps": "optimizer steps (0: derived from --max-tokens)",
    "max_tokens": "training tokens, when --max-steps is 0",
    "stop_at": "stop (with a checkpoint) after this step, as if interrupted; resume later (0: off)",
    "batch_size": "micro-batch per process, in sequences",
    "grad_accum": "micro-batches per optimizer step",
    "seq_len": "tokens per training sequence",
    "lr": "peak learning rate",
    "min_lr_ratio": "final learning rate as a fraction of the peak (cosine, wsd)",
    "warmup_steps": "steps of linear warmup",
    "schedule": "learning-rate schedule after warmup",
    "decay_frac": "wsd: the final fraction of steps spent decaying",
    "weight_decay": "AdamW weight decay",
    "beta1": "AdamW beta1, in [0, 1)",
    "beta2": "AdamW beta2, in [0, 1)",
    "grad_clip": "clip the global gradient norm to this (0: off)",
    "device": "auto, cpu, cuda, cuda:N or mps",
    "dtype": "auto: bf16 autocast on CUDA, fp32 elsewhere",
    "compile": "torch.compile the model",
    "fsdp": "FSDP2 under torchrun (else DDP)",
    "fsdp_reshard_after_forward": "FSDP2: free each block's gathered weights after its forward (least memory); "
                                  "--no-fsdp-reshard-after-forward keeps them for the backward (one all-gather "
                                  "per block and micro-batch less, one more bf16 copy of the weights per GPU)",
    "fsdp_sharded_checkpoints": "FSDP2: each rank writes its own shards of a checkpoint, nothing is gathered "
                                "(--no-fsdp-sharded-checkpoints: gathered to rank 0, which writes one file)",
    "activation_checkpointing": "recompute each block's activations in backward (less memory)",
    "seed": "random seed, in [0, 2^63)",
    "eval_every": "validate every N steps (0: never)",
    "eval_batches": "validation micro-batches (--batch-size rows per process) per evaluation, whatever --grad-accum",
    "save_every": "checkpoint every N steps (0: only at the end)",
    "keep_last": "keep the newest N checkpoints (0: all)",
    "async_checkpoints": "write checkpoints on a background thread while training goes on (--no-async-checkpoints: "
                         "in the loop, for debugging)",
    "log_every": "print a progress line every N steps",
    "gpu_hourly_usd": "GPU price per hour, for the cost estimate (0: off)",
    "on_nonfinite": "a non-finite loss or gradient: stop, or skip that step",
    "max_nonfinite_skips": "with --on-nonfinite skip: stop after this many skipped steps",
    "spike_zscore": "a loss this many standard deviations above the recent mean is a spike",
    "spike_window": "steps of loss history for the spike z-score",
    "on_spike": "a loss spike: warn, or skip (also drop that batch's update)",
    "grad_flow_every": "check gradient flow every N steps (0: never)",
    "skip_gates": "pre-flight gates to skip (emergencies only; recorded loudly in gates.json)",
    "init": "start from this checkpoint's weights (fine-tuning)",
    "init_from": "start from an open LlamaForCausalLM in Hugging Face layout: a local folder (config.json, "
                 "*.safetensors, tokenizer.model) or a hub id when the hub is reachable; its config.json sets the "
                 "model shape and --data must be prepared with its tokenizer.model (docs/init_from.md)",
    "reset_optimizer": "resume from a checkpoint whose optimizer state is missing or unreadable with a fresh "
                       "optimizer (recorded in log.jsonl); without it such a resume is refused",
    "early_stop_patience": "stop after N evaluations without a new best validation loss (0: off)",
    "log_to": "live logging as well as log.jsonl: '' (none) or tensorboard",
    "fused_optimizer": "fused AdamW, which skips a non-finite step on the device so loss and grad norm are read "
                       "only at --log-every: auto (on CUDA), on, off (host checks every step)",
    "cache": "with a URL --out: the local folder the run is trained in and mirrored from "
             "(default ~/.cache/prodip/runs/<hash of the URL>)",
    "allow_local_only": "with a URL --out: exit 0 even when the store was unreachable for the whole run "
                        "(the run is then only in the local cache)",
    "model": "overrides of the preset's model shape: the [model] table, or --set KEY=VALUE",
}

TABLES = ("train", "model")
NOT_FLAGS = ("model", "skip_gates")  # set through --set KEY=VALUE and --skip-gate NAME
NOT_SET = ("model", "skip_gates")  # not settable by --set (a table, a list)
PER_RUN = ("preset", "data", "out", "init", "init_from", "cache")  # a preset's recipe cannot name these


def train_types() -> dict[str, Any]:
    return field_types(TrainConfig)


def train_table(table: dict, where: str) -> dict:
    """A [train] table (of a --config file or a preset) checked key by key, strictly (TOML is typed)."""
    types = {k: v for k, v in train_types().items() if k != "model"}
    unknown = [k for k in table if k not in types]
    if unknown:  # the model's keys belong in [model]: say so rather than "unknown"
        k = unknown[0]
        hint = " (it belongs in [model])" if k in field_types(ModelConfig) else suggest(k, types)
        raise ConfigError(f"{where} [train]: unknown keys {unknown}{hint}; see docs/config.md")
    return {k: check(types[k], v, f"{where} [train] {k}", strict=True) for k, v in table.items()}


def load_toml(path: str | Path) -> dict:
    """A --config file's settings: its [train] keys, and its [model] table under "model", all checked."""
    tables = toml_tables(read_toml(path, "config file"), TABLES, str(path))
    out = train_table(tables["train"], str(path))
    if tables["model"]:
        out["model"] = model_table(tables["model"], str(path))
    return out


def preset_train(name: str) -> dict:
    """The recipe of preset `name`: its [train] table, checked (a preset cannot choose a preset)."""
    path = f"training/presets/{name}.toml"
    table = train_table(preset_tables(name)["train"], path)
    own = [k for k in table if k in PER_RUN]
    if own:
        raise ConfigError(f"{path} [train]: a preset cannot set {own} (they belong to one run)")
    return table


def parse_sets(items: list[str]) -> tuple[dict, dict]:
    """--set KEY=VALUE items as ([train] settings, [model] settings), each value parsed by its field's type."""
    model_types = field_types(ModelConfig)
    types = {k: v for k, v in train_types().items() if k not in NOT_SET}
    train, model = {}, {}
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set n_layers=4")
        if key in model_types:
            model[key] = parse(model_types[key], text, f"--set {key}")
        elif key in types:
            train[key] = parse(types[key], text, f"--set {key}")
        else:
            raise ConfigError(f"--set {key} = {text!r}: unknown key {key!r}{suggest(key, [*model_types, *types])}; "
                              f"--set takes a [model] key ({', '.join(model_types)}) or a [train] key (the flags)")
    return train, model


# ---------------------------------------------------------------------------------------------- CLI
def _arg_type(type_: Any) -> dict:
    """argparse keywords that check a value of `type_` at parse time: choices for a Literal, else flag(T)."""
    if get_origin(type_) is Literal:
        return {"choices": list(get_args(type_))}
    return {"type": flag(type_)}


def add_train_flags(p: argparse.ArgumentParser, exclude: Container[str] = ()) -> argparse.ArgumentParser:
    """One flag per TrainConfig field (--max-steps, ...; booleans as --x/--no-x), plus --config, --skip-gate,
    --set, --force and --debug. `exclude`: fields the caller declares its own way (SFT's --data, --init).
    Every default is None, so config_from_args can tell a flag given from one left out."""
    p.add_argument("--config", metavar="FILE.toml",
                   help="TOML file with [train] and [model] tables: over the preset, under flags (docs/config.md)")
    defaults = TrainConfig()
    types = train_types()
    for f in fields(TrainConfig):
        if f.name in NOT_FLAGS or f.name in exclude:
            continue
        name = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help_ = HELP[f.name].replace("%", "%%")
        if isinstance(default, bool):
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            kw = _arg_type(types[f.name])
            if f.name == "preset":  # a type, not choices: a near miss then gets a suggestion
                kw["metavar"] = "{" + ",".join(preset_names()) + "}"
            p.add_argument(name, default=None, help=f"{help_} (default: {default!r})", **kw)
    p.add_argument("--skip-gate", action="append", default=None, metavar="NAME", type=flag(GateName),
                   help=HELP["skip_gates"])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a [model] or [train] key, e.g. --set n_layers=4 (repeatable; wins over flags)")
    p.add_argument("--force", action="store_true", help="start over in an out dir that holds another run")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def given_keys(args: argparse.Namespace) -> set[str]:
    """The [train] keys a --config file or --set gives (what SFT's own defaults must not override)."""
    keys = set(load_toml(args.config)) if getattr(args, "config", None) else set()
    return keys | set(parse_sets(getattr(args, "set", []) or [])[0])


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed flags: the preset's [train] < --config TOML < flags < --set."""
    toml: dict = load_toml(args.config) if args.config else {}
    flags = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
             if f.name not in NOT_FLAGS and getattr(args, f.name, None) is not None}
    set_train, set_model = parse_sets(args.set)
    name = set_train.get("preset", flags.get("preset", toml.get("preset", TrainConfig.preset)))
    merged = {**preset_train(name), **toml, **flags, **set_train}
    if args.skip_gate:
        merged["skip_gates"] = list(merged.get("skip_gates", [])) + args.skip_gate
    merged["model"] = {**toml.get("model", {}), **set_model}
    cfg = TrainConfig(**merged)
    if not cfg.data:
        raise ConfigError("--data is required (a folder written by `python -m training.prepare`)")
    if not cfg.out:
        raise ConfigError("--out is required (the run folder)")
    try:
        return cfg.validate()
    except SchemaError as e:
        if not str(e).startswith(MODEL_ERROR):
            raise
        # a shape that does not fit together (d_model 512, n_heads 3): name where each override came from
        src = {**{k: f"{args.config} [model] {k}" for k in toml.get("model", {})},
               **{k: f"--set {k}" for k in set_model}}
        given = "; ".join(f"{src[k]} = {v!r}" for k, v in cfg.model.items())
        raise ConfigError(f"{e} (preset {cfg.preset}{'; ' + given if given else ''})") from None

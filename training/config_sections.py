"""Each component's section of the run's settings: a small frozen view of TrainConfig.

TrainConfig stays the one flat form a user writes (TOML keys, flags, `--set` keys, run.json's "train");
a component of the training loop receives only the settings it reads, so what it depends on is in its
constructor's type, and nothing it holds can be changed under it. `Section.of(cfg)` takes each field
of the same name from the TrainConfig; a field with `from_config` metadata is computed from it instead.

    CheckpointSection   training.loop.checkpointer (and the adapter run's, training.lora_run)
    MetricsSection      training.telemetry.metrics_logger
    ValidationSection   training.loop.validator
    MirrorSection       training.mirror.run_mirror
    ChecksSection       training.loop.runtime_checks, training.loop.step_reads
    StepSection         training.loop.step (TrainStep, build_views, total_steps) and training.optim

Whole TrainConfig, by design: RunInputs (its data factory is handed the TrainConfig, and the model's shape
is derived from a dozen of its fields, TrainConfig.model_config) and Preflight (the gates' PreflightContext
hands it to each gate, whose checks read settings of every kind).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Self

from training.train_config import TrainConfig


@dataclass(frozen=True)
class Section:
    @classmethod
    def of(cls, cfg: TrainConfig) -> Self:
        def value(f: Any) -> Any:
            compute = f.metadata.get("from_config")
            return compute(cfg) if compute is not None else getattr(cfg, f.name)

        return cls(**{f.name: value(f) for f in fields(cls)})

    @classmethod
    def default(cls, **given: Any) -> Self:
        """TrainConfig's defaults, then `given`: a component built alone (tests, benchmarks). The sections
        hold no defaults of their own, so they cannot drift from TrainConfig's."""
        return replace(cls.of(TrainConfig()), **given)


@dataclass(frozen=True)
class CheckpointSection(Section):
    data: str  # named in a refusal (a checkpoint of another tokenizer)
    init: str
    seed: int  # seed, seq_len, batch_size: a resume must share them (checkpointer.EXACT_SETTINGS)
    seq_len: int
    batch_size: int
    max_steps: int
    max_tokens: int
    save_every: int
    keep_last: int
    async_checkpoints: bool
    reset_optimizer: bool
    fsdp: bool
    fsdp_sharded_checkpoints: bool
    # the run's whole settings as the user gave them, recorded in each state.json ("train") and read
    # back by a resume; a copy, so the section stays a value
    settings: dict[str, Any] = field(default_factory=dict, metadata={"from_config": TrainConfig.to_dict})


@dataclass(frozen=True)
class MetricsSection(Section):
    seq_len: int
    log_every: int
    log_to: str
    gpu_hourly_usd: float
    fsdp: bool


@dataclass(frozen=True)
class ValidationSection(Section):
    eval_every: int
    eval_batches: int


@dataclass(frozen=True)
class ChecksSection(Section):
    grad_flow_every: int
    on_nonfinite: str
    max_nonfinite_skips: int
    on_spike: str
    spike_window: int  # spike_window, spike_zscore: training.gates' RuntimeMonitor
    spike_zscore: float


@dataclass(frozen=True)
class MirrorSection(Section):
    out: str  # the store URL (a local --out has no mirror)
    cache: str
    keep_last: int


@dataclass(frozen=True)
class StepSection(Section):
    batch_size: int  # batch_size, grad_accum, seq_len, max_steps, max_tokens: the step's tokens, the run's steps
    grad_accum: int
    seq_len: int
    max_steps: int
    max_tokens: int
    grad_clip: float
    dtype: str  # dtype, compile, activation_checkpointing, fsdp*: how build_views wraps the model
    compile: bool
    activation_checkpointing: bool
    fsdp: bool
    fsdp_reshard_after_forward: bool
    # lr .. decay_frac: each step's learning rate (optim.lr_for_step); lr, beta1 .. fused_optimizer: the
    # optimizer build_views makes when the caller hands it none (optim.make_optimizer)
    lr: float
    warmup_steps: int
    schedule: str
    min_lr_ratio: float
    decay_frac: float
    beta1: float
    beta2: float
    weight_decay: float
    fused_optimizer: str

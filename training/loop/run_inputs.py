"""RunInputs: everything a run reads before anything is written, as one component of the Trainer.

    where it lives   --out: a folder, or a store URL trained in a local cache and mirrored (loop.mirror)
    its data         --data: a folder, or a URL pulled into the cache once, checked (training.store.remote_run)
    the model shape  the preset and flags, or --init-from's Hugging Face config (loop.init_from)
    first weights    --init (a prodip run, or one at a store URL, pulled) or --init-from (HF weights,
                     with the import parity gate)

Each read runs on every rank and ends in one agreed verdict (training.loop.rank_agreement.agreed): all ranks
go on, or all stop with the same one-line error; never a hang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from training import distributed as D
from training.config_sections import MirrorSection
from training.data.loaders import TrainingData
from training.loop.checkpointer import Checkpointer
from training.loop.init_from import HFInit
from training.loop.rank_agreement import TrainError, agreed
from training.mirror.run_mirror import Mirror, pull_data
from training.model.decoder import ModelConfig, Transformer
from training.run_context import RunContext
from training.runfiles.gate_results import GateResult
from training.store.remote_data import local_init
from training.store.remote_run import RemoteError
from training.train_config import ConfigError, TrainConfig

DataFactory = Callable[[TrainConfig, D.Dist], TrainingData]


class RunInputs:
    def __init__(self, cfg: TrainConfig, ctx: RunContext, *, data_factory: DataFactory):
        # the whole config: the data factory is handed it (DataFactory, the SFT run's and the tests'), and the
        # model's shape is derived from a dozen of its fields (TrainConfig.model_config)
        self.cfg, self.ctx, self.dist, self.device, self.kind, self.say = cfg, ctx, ctx.dist, ctx.device, ctx.kind, ctx.say
        self.data_factory = data_factory
        self.hf_init = HFInit(cfg.init_from, ctx.say) if cfg.init_from else None

    def open_mirror(self) -> Mirror | None:
        """The mirror of a URL --out (scheme, library, credentials and bucket checked; nothing written);
        None for a local --out. The run folder is the context's out (run_mirror.local_folder)."""
        section = MirrorSection.of(self.cfg)
        return agreed(self.dist, self.device, f"opening --out {self.cfg.out}",
                      lambda: Mirror.open(section, self.ctx))

    def read_data(self, check: Callable[[], None] = lambda: None) -> tuple[TrainingData, ModelConfig]:
        """The data (a URL pulled first) and the model config, with the checks that need both; `check`
        runs in the same agreed read (the tracker's settings)."""
        cfg, d = self.cfg, self.dist
        local = agreed(d, self.device, f"pulling --data {cfg.data}", lambda: pull_data(cfg, self.kind, d, self.say))

        def read() -> tuple[TrainingData, ModelConfig]:
            data = self.data_factory(cfg if local is None else dataclasses.replace(cfg, data=str(local)), d)
            if self.hf_init is not None:  # the shape is the HF config's; the folder's tokenizer must be the data's
                model_cfg = self.hf_init.open(data.tokenizer, cfg.data)
            else:
                model_cfg = cfg.model_config(data.tokenizer.vocab_size)
            if cfg.seq_len > model_cfg.max_seq_len:
                raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
            if cfg.early_stop_patience and not (data.val and cfg.eval_every):
                raise ConfigError(f"--early-stop-patience {cfg.early_stop_patience} needs validation: "
                                  f"--eval-every > 0 and a validation split in {cfg.data}")
            check()
            return data, model_cfg

        return agreed(d, self.device, f"reading --data {cfg.data}", read)

    def init_weights(self, model: Transformer, data: TrainingData, checkpointer: Checkpointer) -> None:
        """A fresh run's first weights, on the CPU before wrapping: --init's run, or --init-from's HF folder."""
        cfg = self.cfg
        if cfg.init:  # a run at a store URL: its newest committed checkpoint pulled first, once per machine
            path = agreed(self.dist, self.device, f"pulling --init {cfg.init}", self._pull_init)
            self.say(f"initialized from {checkpointer.init_from(model, data.tokenizer.sha256, path)}")
        if self.hf_init is not None:
            agreed(self.dist, self.device, f"importing --init-from {cfg.init_from}",
                   lambda: self.hf_init.load(model, data))

    def _pull_init(self) -> str:
        try:
            return local_init(self.cfg.init, self.say)
        except RemoteError as e:  # a URL that holds no run, a bucket that is not there: one error line
            raise TrainError(str(e)) from None

    @property
    def gates(self) -> list[GateResult]:
        """The import parity gate's result, once init_weights ran (a resumed run has none)."""
        return self.hf_init.gates if self.hf_init is not None else []

"""prodip training: `python training/train.py --preset small --data DATA --out RUN` (or under torchrun).

Runs the same command again to resume from the newest complete checkpoint, exactly: the data
position, optimizer moments, schedule and RNG states are restored, and log.jsonl continues as if the
run had never stopped. Pre-flight gates (training.gates) must pass before step 1.

`--plan` prints the run's size, memory per GPU, time and cost, and exits without allocating or writing
anything (training.run_plan). A preset's grad_accum is its recipe's for one GPU: under torchrun on W GPUs
each process accumulates 1/W of it, so the tokens per step stay the recipe's (a --grad-accum given
by flag, --config or --set is per process, as written).
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as `python training/train.py`: make the repo root importable
    import sys
    from pathlib import Path as _P

    sys.path.insert(0, str(_P(__file__).resolve().parents[1]))

import argparse
import os
import sys

from training.data.loaders import pretraining_data
from training.model.decoder import Transformer
from training.run_plan import add_plan_flags, per_gpu_grad_accum, plan, world_size
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.schema import SchemaError
from training.schedule import lr_at
from training.train_config import (
    ConfigError,
    TrainConfig,
    add_train_flags,
    config_from_args,
    given_keys,
    preset_train,
)
from training.trainer import RESUME_HINT, USER_ERRORS, Trainer


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python training/train.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_flags(p)
    add_plan_flags(p)
    return p


PLAN_ONLY = ("gpu", "gpu_mem_gb", "gpus", "tokens_per_s", "mfu")  # flags that only mean something with --plan


def resolve(args: argparse.Namespace, gpus: int) -> TrainConfig:
    """The run's TrainConfig, with a preset's one-GPU grad_accum spread over `gpus` GPUs (module docstring)."""
    cfg = config_from_args(args)
    recipe = preset_train(cfg.preset).get("grad_accum")
    if gpus > 1 and recipe and args.grad_accum is None and "grad_accum" not in given_keys(args):
        cfg.grad_accum = per_gpu_grad_accum(recipe, gpus)
        if os.environ.get("RANK", "0") == "0" and not args.plan:
            print(f"grad_accum {cfg.grad_accum} per GPU: preset {cfg.preset}'s {recipe} (one GPU) over {gpus} GPUs "
                  "(--grad-accum sets it)")
    return cfg


def train(cfg: TrainConfig, *, force: bool = False) -> dict:
    """Pretrain (or resume) on cfg.data; returns the run's summary."""
    # Transformer and lr_at are looked up here, at call time: tests/gates_runner.py plants its defects
    # by replacing these two names in this module, so the plant lives in the exact object that trains.
    return Trainer(cfg, pretraining_data, kind="pretrain", force=force, model_class=Transformer,
                   lr_schedule=lr_at).run()


def main(argv: list[str] | None = None) -> int:
    def go(args: argparse.Namespace) -> None:  # every flag, TOML key and --set value is checked first
        if not args.plan:
            given = [f"--{k.replace('_', '-')}" for k in PLAN_ONLY if getattr(args, k) is not None]
            if given:
                raise ConfigError(f"{given[0]} only applies with --plan")
            train(resolve(args, world_size()), force=args.force)
            return
        plan(resolve(args, args.gpus or world_size()), gpu=args.gpu, gpu_mem_gb=args.gpu_mem_gb, gpus=args.gpus,
             tokens_per_s=args.tokens_per_s, mfu=args.mfu)

    return run_main(build_parser(), argv, go, errors=(*USER_ERRORS, SchemaError), interrupted_hint=RESUME_HINT)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

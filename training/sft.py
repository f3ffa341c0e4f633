"""Supervised fine-tuning on conversations, through the one training loop (training.trainer.Trainer).

    python training/sft.py --init RUN_OR_CHECKPOINT --data FILE.jsonl [--data FILE2.jsonl] --out SFT_RUN
           [--epochs 3 | --max-steps N] [every training/train.py flag that makes sense]
    --data may be a store URL (s3://BUCKET/PREFIX: one file or a folder of them), pulled once (training.store.remote_data).

Records are JSONL (or one JSON array) in any of these shapes:
    {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}    (OpenAI-style)
    {"instruction": ..., "input": ..., "output": ..., "system"?: ...}               (Alpaca)
    {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}       (ShareGPT)
Each conversation is rendered by training.text.chat_template (the one ChatML template) into its own row of
seq_len + 1 tokens, right-padded with <pad>: one conversation per row, so with causal attention no
conversation can attend to another, and padding never reaches a real token. The loss counts
assistant tokens only (their content and the <|im_end|> that ends the turn): with y = ids shifted by
one, loss_mask[t] = assistant_mask[t + 1]. A conversation longer than the row is cut (and counted).
Validation: the records whose "split" is a held-out split (test/validation/dev) when any has one,
else a deterministic 5 % by content hash. The weights come from --init, whose tokenizer the run
keeps; the run folder, gates and checkpoints are exactly those of pretraining (run kind "sft"),
so export, serving and the demo take an SFT run like any other.

Two data gates are decided by the conversations alone and checked before anything is written: no
held-out conversation also in training (data.train_val_disjoint), and --seq-len long enough that at
most 25 % of the training conversations are cut or dropped (data.truncation). Either failing is one
`error:` line and exit 2; gates.json records both again with the other pre-flight gates.

--lora-rank R trains LoRA adapters instead of every weight (training.model.lora, training.lora_run): the --init
model frozen, rank-R adapters on the linears --lora-targets names (default all seven), adapter-only
checkpoints that name the base by path and sha256, and the adapter gates (training.gates.adapters).
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as `python training/sft.py`: make the repo root importable
    import sys
    from pathlib import Path as _P

    sys.path.insert(0, str(_P(__file__).resolve().parents[1]))

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from training.checkpoint import checkpoint_io as ckpt
from training.data.loaders import Row, collate
from training.data.sft_records import KIND, SFTData, SFTError
from training.model.decoder import ModelConfig
from training.model.lora import LoRAError, LoRASpec, add_lora_flags, spec_from_args
from training.runfiles import layout
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.file_ops import Input, check_apart
from training.runfiles.schema import PositiveFloat, SchemaError, flag
from training.store.remote_data import PULLED, local_init, pull_data
from training.store.remote_run import RemoteError, is_url
from training.text.tokenizer import Tokenizer
from training.train_config import ConfigError, TrainConfig, add_train_flags, given_keys
from training.train_config import config_from_args as train_config_from_args
from training.trainer import RESUME_HINT, USER_ERRORS, Trainer

REPORT_FILE = "sft_data.json"
DEFAULT_EPOCHS = 3.0
REPORT_MAX_VAL_ROWS = 512  # the before/after held-out loss in sft_data.json reads at most this many
# Fine-tuning defaults that differ from pretraining's (a TOML file or a flag still overrides them).
# No weight decay: it would pull the pretrained weights toward zero. The peak LR is a fraction of the
# --init run's own: lower, so the pretrained weights are not pulled away, but not so low that one
# batch cannot be memorized (the overfit_one_batch gate trains with it: at 1/10 a tiny model fails).
SFT_DEFAULTS: dict[str, object] = {"weight_decay": 0.0, "warmup_steps": 10, "eval_every": 50, "save_every": 100}
SFT_LR_SCALE = 1 / 3  # default --lr: this times the --init run's peak LR
FALLBACK_LR = 1e-3  # when the --init checkpoint does not record its LR


# ------------------------------------------------------------------------------------- measuring
@torch.no_grad()
def heldout_loss(model: torch.nn.Module, rows: Sequence[Row], seq_len: int, pad_id: int, *, batch_size: int = 16,
                 device: str | torch.device = "cpu") -> float:
    """Mean cross-entropy (nats) over every assistant token of `rows` (token-weighted, not per batch)."""
    if not rows:
        raise SFTError("no held-out conversations to measure")
    total, count = 0.0, 0.0
    was = model.training
    model.eval()
    for i in range(0, len(rows), batch_size):
        x, y, m = collate(rows[i:i + batch_size], seq_len, pad_id)
        _, s = model(x.to(device), y.to(device), loss_mask=m.to(device), reduction="sum")
        total += float(s)
        count += float(m.sum())
    model.train(was)
    return total / count


# ------------------------------------------------------------------------------------------- run
def init_checkpoint(init: str) -> tuple[Path, ModelConfig, Tokenizer]:
    """The --init checkpoint folder, its model config and its tokenizer (weights are read by the loop)."""
    if not init:
        raise SFTError("--init is required (the pretrained run folder or checkpoint to fine-tune)")
    c = ckpt.resolve(init)
    try:
        cfg = ModelConfig.from_dict(layout.read_json(c / layout.MODEL_CONFIG, "model config"))
    except (TypeError, ValueError) as e:  # LayoutError included
        raise SFTError(f"{c}: unreadable model config ({e})") from None
    return c, cfg, Tokenizer.load(c / layout.TOKENIZER)


def check_out_dir(out: Path, init_dir: Path) -> None:
    """SFT writes its own run folder: never the --init run's, never another kind of run's."""
    out = out.resolve()
    if out == init_dir.resolve() or out in init_dir.resolve().parents:
        raise SFTError(f"--out {out} is (or holds) the --init checkpoint; fine-tune into a new run folder")
    try:
        old = layout.read_run_config(out)
    except layout.LayoutError:
        return  # the Trainer's run-folder check reports it
    if old is not None:
        if old.get("kind") != KIND:
            raise SFTError(f"--out {out} holds a {old.get('kind')!r} run, not an SFT run; choose another --out")
        old_init = old.get("train", {}).get("init", "")
        if old_init and Path(old_init).resolve() != init_dir.resolve():
            # resuming would silently ignore the new --init: the run there was fine-tuned from another
            raise SFTError(f"--out {out} holds an SFT run from --init {old_init}, not {init_dir}; "
                           "choose another --out (or delete that one)")


def default_lr(init: str) -> float:
    """SFT_LR_SCALE x the peak LR the --init checkpoint was trained with (FALLBACK_LR if unrecorded)."""
    c = ckpt.resolve(init)
    try:
        train = layout.read_json(c / layout.STATE, "checkpoint state").get("train")
        lr = train.get("lr") if isinstance(train, dict) else None
    except layout.LayoutError:
        lr = None
    return float(lr) * SFT_LR_SCALE if isinstance(lr, (int, float)) and lr > 0 else FALLBACK_LR


def epochs_to_steps(epochs: float, n_rows: int, cfg: TrainConfig, world_size: int) -> int:
    return max(1, math.ceil(epochs * n_rows / (cfg.batch_size * cfg.grad_accum * world_size)))


def run_sft(cfg: TrainConfig, *, force: bool = False, epochs: float | None = None, quiet: bool = False,
            lora: LoRASpec | None = None) -> dict:
    """Fine-tune `cfg.init` on the conversations in `cfg.data` (os.pathsep-separated files) into `cfg.out`.

    `epochs` (when given) sets max_steps from the number of training conversations. Returns the
    loop's summary plus the data report, which is also written to OUT/sft_data.json."""
    init_dir, init_cfg, tok = init_checkpoint(cfg.init)
    check_out_dir(Path(cfg.out), init_dir)
    # the model is the init's exactly; --set may only repeat it (the loop checks)
    cfg = dataclasses.replace(cfg, init=str(init_dir),
                              model={**{k: v for k, v in init_cfg.to_dict().items() if k != "vocab_size"}, **cfg.model})
    data = SFTData.load([f for f in cfg.data.split(os.pathsep) if f], tok, cfg.seq_len)
    data.check_content(cfg.skip_gates)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if epochs is not None:
        cfg = dataclasses.replace(cfg, max_steps=epochs_to_steps(epochs, len(data.train), cfg, world), max_tokens=0)
    is_main = int(os.environ.get("RANK", "0")) == 0
    say = print if is_main and not quiet else (lambda *a, **k: None)
    tr = data.stats["train"]
    say(f"SFT data: {len(data.train)} training / {len(data.val)} validation conversations ({data.split_by}); "
        f"{tr['assistant_tokens']:,} of {tr['tokens']:,} training tokens are assistant tokens; "
        f"{tr['truncated']} cut to --seq-len {cfg.seq_len}, {tr['dropped_no_assistant_in_window']} dropped "
        f"(no assistant token within it)")
    if lora is None:
        summary = Trainer(cfg, data.training_data, kind=KIND, force=force).run()
    else:  # lazily: a full fine-tuning never imports the adapter machinery
        from training.lora_run import LoRATrainer

        summary = LoRATrainer(cfg, data.training_data, spec=lora, kind=KIND, force=force).run()
    report = {"init": str(init_dir), "files": data.files, "seq_len": cfg.seq_len, "split_by": data.split_by,
              **data.stats, "max_steps": cfg.max_steps}
    if is_main and data.val:
        report["heldout"] = compare_heldout(init_dir, Path(cfg.out), data, cfg, adapter=lora is not None)
        h = report["heldout"]
        say(f"held-out assistant-token loss ({h['conversations']} conversations): {h['init_loss']:.4f} before SFT "
            f"-> {h['sft_loss']:.4f} after")
    if is_main:
        (Path(cfg.out) / REPORT_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return {**summary, "sft": report}


def compare_heldout(init_dir: Path, out: Path, data: SFTData, cfg: TrainConfig, adapter: bool = False) -> dict:
    """Held-out assistant-token loss of the --init weights and of the newest SFT checkpoint (`adapter`:
    an adapter checkpoint, applied to its base)."""
    device = "cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    rows = data.val[:REPORT_MAX_VAL_ROWS]
    res = {"conversations": len(rows)}
    for key, path in (("init_loss", init_dir), ("sft_loss", out)):
        if adapter and key == "sft_loss":
            from training.checkpoint.adapter_io import load_adapted

            model, _ = load_adapted(path, device=device)
            ck_path = ckpt.resolve(path)
        else:
            model, ck = ckpt.load_model(path, device=device)
            ck_path = ck.path
        res[key] = heldout_loss(model, rows, data.seq_len, data.tokenizer.pad_id, batch_size=cfg.batch_size,
                                device=device)
        if key == "sft_loss":
            res["sft_checkpoint"] = str(ck_path)
        del model
    return res


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """Every flag of the training loop (training.train_config.add_train_flags), with SFT's own --data, --init
    and --epochs."""
    p = ArgumentParser(prog="python training/sft.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="SFT defaults (instead of the pretraining ones shown above): "
                              + ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in SFT_DEFAULTS.items())
                              + f", --lr {SFT_LR_SCALE:.3g} x the --init run's (else {FALLBACK_LR:g})"
                              + ", --seq-len: the --init model's max_seq_len")
    add_train_flags(p, exclude=("data", "init"))
    p.add_argument("--data", action="append", required=True, metavar="FILE.jsonl",
                   help="conversations (messages / Alpaca / ShareGPT JSONL); repeatable; or a store URL "
                        "(s3://BUCKET/PREFIX: one file or a folder of .jsonl/.json, pulled once, checksums checked)")
    p.add_argument("--init", required=True, metavar="RUN_OR_CHECKPOINT", help="the pretrained weights to fine-tune: a run folder, a checkpoint, or a run at a store URL (s3://BUCKET/RUN)")
    p.add_argument("--epochs", type=flag(PositiveFloat), default=None,
                   help=f"passes over the training conversations (default {DEFAULT_EPOCHS:g} unless --max-steps/--max-tokens)")
    add_lora_flags(p)
    return p


def local_data(files: Sequence[str]) -> list[str]:
    """--data as local files: a store URL (one JSONL/JSON file, or a folder of them) is pulled once into
    ~/.cache/prodip/data/ with its checksums checked (training.store.remote_data, as train.py's --data), and
    stands for the .jsonl/.json files there in name order; local files are kept as given."""
    out = []
    for f in files:
        if not is_url(f):
            out.append(f)
            continue
        say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a: None)
        try:
            folder = pull_data(f, say)
        except RemoteError as e:
            raise SFTError(str(e)) from None
        found = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".json")
                       and p.name != PULLED)
        if not found:
            raise SFTError(f"--data {f}: holds no .jsonl or .json file of conversations")
        out += [str(p) for p in found]
    return out


def local_init_run(init: str) -> str:
    """--init as a local path (a run at a store URL pulled first: training.store.remote_data.local_init)."""
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a: None)
    try:
        return local_init(init, say)
    except RemoteError as e:
        raise SFTError(str(e)) from None


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, float | None]:
    """(TrainConfig, epochs or None). Precedence: SFT defaults < TOML < flags < --set, as in train.py."""
    toml_keys = given_keys(args)  # the --config file's [train] keys and --set's
    inputs = [*(Input("--data", d) for d in args.data), Input("--init", args.init)]
    for out_flag in ("--out", "--cache"):  # before anything is pulled: as given, URLs included
        check_apart(out_flag, getattr(args, out_flag[2:]), inputs, SFTError)
    ns = copy.copy(args)
    ns.data = os.pathsep.join(local_data(args.data))
    ns.init = local_init_run(args.init)  # a run at a store URL: its newest committed checkpoint, pulled
    for k, v in SFT_DEFAULTS.items():
        if getattr(ns, k) is None and k not in toml_keys:
            setattr(ns, k, v)
    if ns.seq_len is None and "seq_len" not in toml_keys:
        _, init_cfg, _ = init_checkpoint(ns.init)
        ns.seq_len = init_cfg.max_seq_len  # default: the whole context the model was trained for
    if ns.lr is None and "lr" not in toml_keys:
        ns.lr = default_lr(ns.init)
    epochs = args.epochs
    steps_given = any(getattr(args, k) is not None or k in toml_keys for k in ("max_steps", "max_tokens"))
    if epochs is not None and steps_given:
        raise ConfigError("give --epochs or --max-steps/--max-tokens, not both")
    if epochs is None and not steps_given:
        epochs = DEFAULT_EPOCHS
    if epochs is not None:
        ns.max_steps = 1  # placeholder for validation; run_sft derives the real count from the data
    return train_config_from_args(ns), epochs


def lora_spec(args: argparse.Namespace, cfg: TrainConfig) -> LoRASpec | None:
    """--lora-* checked against the --init model and the run folder, before anything is written."""
    init_dir, init_cfg, _ = init_checkpoint(cfg.init)
    spec = spec_from_args(args, init_cfg)
    if spec is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise LoRAError("--lora-rank trains on one process: run training/sft.py without torchrun")
    latest = ckpt.latest(Path(cfg.out)) if Path(cfg.out).is_dir() else None
    if spec is None and latest is not None and "lora" in layout.read_json(latest / layout.STATE, "checkpoint state"):
        raise LoRAError(f"--out {cfg.out} holds an adapter run (LoRA): repeat its --lora-* flags, or use another --out")
    return spec


def main(argv: list[str] | None = None) -> int:
    def go(args: argparse.Namespace) -> None:
        cfg, epochs = config_from_args(args)
        run_sft(cfg, force=args.force, epochs=epochs, lora=lora_spec(args, cfg))

    return run_main(build_parser(), argv, go, errors=(*USER_ERRORS, SchemaError, SFTError, LoRAError),
                    interrupted_hint=RESUME_HINT)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

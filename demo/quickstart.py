"""The one-command CPU quickstart: prepare -> pretrain -> SFT -> export all -> parity -> demo.

    python -m demo.quickstart [--out runs/quickstart] [--corpus PATH] [--steps 200] [--no-demo]

Each stage runs as the same command a user would type, and is skipped when its output already
exists, so a second run opens the demo at once. Everything lands under --out:

    OUT/data/   the prepared corpus (tokenizer, shards, fertility report)
    OUT/base/   the pretrained run          OUT/chat/  the chat fine-tuned run
    OUT/chat/export/{hf/, onnx/, gguf/chat-Q4_K_M.gguf (and -F16, -Q8_0), parity.md, README.md}
    OUT/chat/export/web/   the chat as a static page that runs in the browser (`python -m serving OUT/chat --web`)
    OUT/chat/eval/eval.json   bits/byte of the model and of its random-init twin (the demo's card)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

from pydantic import Field

import training
from demo.models import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    QUICKSTART_BASE,
    QUICKSTART_CHAT,
    QUICKSTART_DATA,
    QUICKSTART_GGUF_GLOB,
    QUICKSTART_RUN,
    quickstart_gguf_dir,
)
from training.checkpoint import checkpoint_io as ckpt
from training.model.decoder import preset_names
from training.runfiles import layout
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.schema import HF_PREFIX, Port, flag

ASSETS = Path(training.__file__).resolve().parent / "assets"
DEFAULT_CORPUS = ASSETS / "corpus"
DEFAULT_CHAT = ASSETS / "chat" / "prodip_chat_bn.jsonl"
HELDOUT = ASSETS / "eval" / "heldout_bn.txt"  # held-out text written for prodip: bits/byte vs the twin
TRAIN_PY = Path(training.__file__).resolve().parent / "train.py"
SFT_PY = Path(training.__file__).resolve().parent / "sft.py"
EVAL_JSON = layout.EVAL_FILES[0]  # eval.json
EXIT_PARITY_BREACH = 1  # `python -m export`: files written, a parity threshold breached
WEB_PAGE = "index.html"  # export web's wllama page (the GGUF in the browser)

# The recipe, chosen by measured held-out bits per byte (training/assets/eval/heldout_bn.txt) in short
# probes on the shipped corpus; docs/eval.md has the table. The corpus is small (~34 k training tokens at
# vocab 4096), so a few epochs overfit: validation every EVAL_EVERY steps stops the run after PATIENCE
# evaluations without a new best, and the best checkpoint is the one exported.
VOCAB_SIZE = 4096
# Without --preset: the `small` preset narrowed to d_model 256 (4.2 M parameters at vocab 4096, 512
# context), sized to the shipped corpus (~34 k training tokens: the full `small`, 14.7 M, memorizes it
# within a few epochs) at under a third of the full preset's FLOPs per step. docs/eval.md: measurements.
DEFAULT_PRESET = "small"
MODEL_OVERRIDES = {"d_model": 256, "ffn_dim": 768, "n_heads": 4, "n_kv_heads": 2}
PRETRAIN_STEPS, PRETRAIN_LR, PRETRAIN_WARMUP = 200, "3e-3", "20"
SFT_STEPS, SFT_LR, SFT_WARMUP = 80, "1e-3", "10"
BATCH, SEQ_LEN = "8", "256"
EVAL_EVERY, PATIENCE = 20, 2
# Bounds that fail here, before minutes of work: uint16 token shards hold at most 65,536 ids, and
# SentencePiece needs room for every character of the corpus plus the specials.
VocabSize = Annotated[int, Field(ge=256, le=65536)]
Steps = Annotated[int, Field(gt=0, le=2**62)]


class QuickstartError(ValueError):
    """A stage failed or an input is missing: one `error:` line through training.runfiles.cli_harness.guarded."""


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m demo.quickstart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("PRODIP_HOME", ".")) / QUICKSTART_RUN)
    ap.add_argument("--corpus", type=Path, action="append", help="text to pretrain on, or hf:NAME[:CONFIG][:SPLIT] (default: the shipped corpus)")
    ap.add_argument("--chat", type=Path, default=DEFAULT_CHAT, help="conversations for SFT (messages JSONL)")
    ap.add_argument("--preset", default=None, choices=preset_names(),
                    help=f"model shape (default: {DEFAULT_PRESET} with "
                         f"{', '.join(f'{k}={v}' for k, v in MODEL_OVERRIDES.items())})")
    ap.add_argument("--vocab-size", type=flag(VocabSize), default=VOCAB_SIZE)
    ap.add_argument("--steps", type=flag(Steps), default=PRETRAIN_STEPS,
                    help="most pretraining steps (8 x 256 tokens each); validation may stop it earlier")
    ap.add_argument("--sft-steps", type=flag(Steps), default=SFT_STEPS)
    ap.add_argument("--no-demo", action="store_true", help="stop after export and parity")
    ap.add_argument("--host", default=DEFAULT_HOST)
    ap.add_argument("--port", type=flag(Port), default=DEFAULT_PORT)
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def stage(name: str, cmd: list[str], tolerate: tuple[int, ...] = ()) -> int:
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    if rc != 0 and rc not in tolerate:
        raise QuickstartError(f"{name} failed (exit {rc}); see the output above")
    print(f"=== {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


def finished(run_dir: Path, steps: int) -> bool:
    """The run reached `steps`, or validation stopped it early (its newest checkpoint is the best)."""
    if (run_dir / layout.EARLY_STOP).is_file():
        return ckpt.latest(run_dir) is not None
    last = ckpt.latest(run_dir)
    return last is not None and layout.read_json(last / layout.STATE, "checkpoint state")["step"] >= steps


def model_flags(preset: str | None) -> list[str]:
    """--preset (and, for the default, MODEL_OVERRIDES as --set KEY=VALUE)."""
    if preset is not None:
        return ["--preset", preset]
    return ["--preset", DEFAULT_PRESET, *sum((["--set", f"{k}={v}"] for k, v in MODEL_OVERRIDES.items()), [])]


def early_stop_flags() -> list[str]:
    """`--early-stop-patience N`: the quickstart's runs stop when validation stops improving."""
    return ["--early-stop-patience", str(PATIENCE)]


def check_inputs(a: argparse.Namespace) -> None:
    """Fail before the first stage, not minutes into it (numbers and names: argparse, by the schema)."""
    if a.out.exists() and not a.out.is_dir():
        raise QuickstartError(f"--out {a.out} is a file, not a folder")
    for p in [*(a.corpus or []), a.chat]:
        if str(p).startswith(HF_PREFIX):
            continue  # a Hugging Face dataset, streamed by training.prepare (which checks it before writing)
        if not p.exists():
            raise QuickstartError(f"input not found: {p}")


def build(a: argparse.Namespace) -> bool:
    """Every stage that has not run yet; True when a parity threshold is breached."""
    py = sys.executable
    data, base, chat = a.out / QUICKSTART_DATA, a.out / QUICKSTART_BASE, a.out / QUICKSTART_CHAT
    if not (data / layout.DATA_META).is_file():
        inputs = [str(p) for p in (a.corpus or [DEFAULT_CORPUS])]
        stage("prepare", [py, "-m", "training.prepare", *sum((["--input", p] for p in inputs), []), "--out", str(data),
                          "--vocab-size", str(a.vocab_size)])
    if not finished(base, a.steps):
        every = str(min(EVAL_EVERY, a.steps))
        stage("pretrain", [py, str(TRAIN_PY), *model_flags(a.preset), "--data", str(data), "--out", str(base),
                           "--max-steps", str(a.steps), "--batch-size", BATCH, "--seq-len", SEQ_LEN,
                           "--lr", PRETRAIN_LR, "--warmup-steps", PRETRAIN_WARMUP, "--eval-every", every,
                           "--save-every", every, "--log-every", "10", *early_stop_flags()])
    if not finished(chat, a.sft_steps):
        every = str(min(EVAL_EVERY, a.sft_steps))
        stage("sft", [py, str(SFT_PY), "--init", str(base), "--data", str(a.chat), "--out", str(chat),
                      "--max-steps", str(a.sft_steps), "--batch-size", BATCH, "--seq-len", SEQ_LEN, "--lr", SFT_LR,
                      "--warmup-steps", SFT_WARMUP, "--eval-every", every, "--save-every", every,
                      "--log-every", "10", *early_stop_flags()])
    parity = chat / layout.EXPORT / layout.PARITY_JSON
    breached = None
    if not parity.is_file():
        rc = stage("export + parity", [py, "-m", "export", "all", str(chat), "--q8", "--q4", "--f16", "--int8", "--int4"],
                   tolerate=(EXIT_PARITY_BREACH,))
        breached = rc == EXIT_PARITY_BREACH
    if not (chat / layout.EXPORT / layout.WEB_DIR / WEB_PAGE).is_file():  # the page that runs on the visitor's device
        stage("web export", [py, "-m", "export", "web", str(chat), "--force"])
    # the card's "bits/byte vs random-init twin" (seconds at this size); after export, so the exported
    # model card (export/README.md) gets the evaluation section too
    if not (chat / layout.EVAL_DIR / EVAL_JSON).is_file():
        stage("evaluate vs twin", [py, "-m", "training.evaluate", str(chat), "--text", str(HELDOUT), "--no-progress"])
    if breached is not None:
        return breached
    return not layout.read_json(parity, "parity report").get("passed", False)


def run(a: argparse.Namespace) -> int:
    check_inputs(a)
    t0 = time.perf_counter()
    breached = build(a)
    chat = a.out / QUICKSTART_CHAT
    export_dir = chat / layout.EXPORT
    if breached:  # loud, but the demo still opens: parity.md says which backend breached which threshold
        print(f"warning: parity thresholds breached, see {export_dir / layout.PARITY_MD}; do not ship those files",
              file=sys.stderr)
    print(f"\nquickstart ready in {time.perf_counter() - t0:.0f} s: run folder {chat}, exports in {export_dir}, "
          f"parity report {export_dir / layout.PARITY_MD}")
    print(f"the chat in your browser, on your own device: python -m serving {chat} --web "
          f"(the page: {export_dir / layout.WEB_DIR / WEB_PAGE}; docs/web.md)")
    if a.no_demo:
        return EXIT_PARITY_BREACH if breached else 0
    ggufs = sorted(quickstart_gguf_dir(a.out).glob(QUICKSTART_GGUF_GLOB))
    model = ggufs[0] if ggufs else chat
    stage("demo", [sys.executable, "-m", "demo", "--model", str(model), "--host", a.host, "--port", str(a.port)])
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), argv, run, errors=(QuickstartError, layout.LayoutError, OSError))


if __name__ == "__main__":
    sys.exit(main())

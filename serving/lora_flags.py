"""`python -m serving BASE.gguf --lora ADAPTER.gguf [--lora-scale S]`: a LoRA adapter applied by llama.cpp at
run time (serving.llamacpp_lora checks it fits the base first). An adapter run folder (training/sft.py
--lora-rank) needs no flag: `python -m serving RUN` serves its base with the adapter (serving.torch_backend)."""

from __future__ import annotations

import argparse
from pathlib import Path

from serving.backend import ServingError
from training.schema import NonNegFloat, flag

DEFAULT_SCALE = 1.0


def add_lora_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lora", metavar="ADAPTER.gguf",
                    help="a LoRA GGUF (python -m export gguf ADAPTER_RUN) applied to the .gguf model at run time")
    ap.add_argument("--lora-scale", type=flag(NonNegFloat), default=None,
                    help=f"the adapter's strength, times its alpha/rank (default {DEFAULT_SCALE:g}; 0 = the base alone)")


def lora_kwargs(args: argparse.Namespace) -> dict:
    """The backend's lora / lora_scale arguments, or {}; bad combinations refused by name."""
    if args.lora is None:
        if args.lora_scale is not None:
            raise ServingError("--lora-scale given without --lora ADAPTER.gguf")
        return {}
    model = Path(args.model)  # a missing model is load()'s to report, naming it
    if (model.exists() and model.suffix != ".gguf") or args.backend not in (None, "llama.cpp"):
        raise ServingError(f"--lora {args.lora}: llama.cpp applies LoRA GGUFs, to a .gguf model; {args.model} is not "
                           "one (an adapter run folder is served with its adapter without --lora)")
    scale = DEFAULT_SCALE if args.lora_scale is None else args.lora_scale
    return {"lora": args.lora, "lora_scale": scale}

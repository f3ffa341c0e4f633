"""`python -m serving BASE.gguf --lora [NAME=]ADAPTER.gguf ... [--lora-scale S]`: LoRA adapters applied by
llama.cpp at run time (serving.backends.llamacpp_lora checks each fits the base first). --lora repeats: every adapter
is loaded once beside the one base, the first is the default, and an HTTP request picks another by name
(`"adapter": "NAME"`, or "base" for the base alone: serving.lora_pairs). A bare path is named by its file
stem. --lora-scale is one strength for every adapter. An adapter run folder (training/sft.py --lora-rank)
needs no flag: `python -m serving RUN` serves its base with the adapter (serving.backends.torch_backend)."""

from __future__ import annotations

import argparse
from pathlib import Path

from serving.backend import ServingError
from serving.backends.llamacpp_lora import NAME, check_name
from training.runfiles.schema import NonNegFloat, flag

DEFAULT_SCALE = 1.0


def add_lora_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lora", metavar="[NAME=]ADAPTER.gguf", action="append",
                    help="a LoRA GGUF (python -m export gguf ADAPTER_RUN) applied to the .gguf model at run time; "
                         "repeat for several, each NAME= (default: the file stem); the first is the default")
    ap.add_argument("--lora-scale", type=flag(NonNegFloat), default=None,
                    help=f"every adapter's strength, times its alpha/rank (default {DEFAULT_SCALE:g}; 0 = the base alone)")


def split_named(text: str) -> tuple[str, str]:
    """'NAME=PATH' -> (NAME, PATH) when what precedes '=' is a name (no '/'); else (the file stem, text)."""
    name, eq, path = text.partition("=")
    if eq and "/" not in name and "\\" not in name:
        return check_name(name), path
    stem = Path(text).stem
    if not NAME.fullmatch(stem):  # a stem that is no name must be named: NAME=PATH
        raise ServingError(f"--lora {text}: its file stem {stem!r} is not an adapter name; give one, NAME={text}")
    return check_name(stem), text


def lora_kwargs(args: argparse.Namespace) -> dict:
    """The backend's lora ({NAME: path}, in the order given) / lora_scale arguments, or {}; bad combinations
    refused by name."""
    if not args.lora:
        if args.lora_scale is not None:
            raise ServingError("--lora-scale given without --lora ADAPTER.gguf")
        return {}
    model = Path(args.model)  # a missing model is load()'s to report, naming it
    if (model.exists() and model.suffix != ".gguf") or args.backend not in (None, "llama.cpp"):
        raise ServingError(f"--lora {args.lora[0]}: llama.cpp applies LoRA GGUFs, to a .gguf model; {args.model} "
                           "is not one (an adapter run folder is served with its adapter without --lora)")
    named: dict[str, str] = {}
    for text in args.lora:
        name, path = split_named(text)
        if name in named:
            raise ServingError(f"--lora {text}: the adapter name {name!r} is given twice (also {named[name]}); "
                               f"name each one: --lora NAME={path}")
        named[name] = path
    scale = DEFAULT_SCALE if args.lora_scale is None else args.lora_scale
    return {"lora": named, "lora_scale": scale}

"""Documents for the prodip_mc tasks: each item as training.evaluate.mc reads it (`load_mc`), so the
context and each continuation (with its joining space, from `join_choice`) are the very strings
training.evaluate scores. The YAML files then join them with target_delimiter "" and take the
continuations as the choices, which makes lm_eval's length normalizations (acc_norm: characters,
acc_bytes: UTF-8 bytes of the choice) the same as ours (acc_norm_char, acc_norm_byte)."""

from __future__ import annotations

from pathlib import Path

import datasets

import training
from training.evaluate import load_mc

EVAL_DIR = Path(training.__file__).resolve().parent / "assets" / "eval"  # shipped as package data
SPLIT = "test"


def docs(name: str) -> list[dict]:
    """The items of training/assets/eval/NAME.jsonl as {"context", "choices", "gold"} records."""
    _, items = load_mc(EVAL_DIR / f"{name}.jsonl")
    out = []
    for i, it in enumerate(items):
        if len(set(it.contexts)) != 1:  # lm_eval's multiple_choice scores every choice after one context
            raise ValueError(f"{name} item {i}: choices with different contexts are not supported here")
        out.append({"context": it.contexts[0], "choices": it.continuations, "gold": it.gold})
    return out


def _dataset(name: str) -> dict[str, datasets.Dataset]:
    return {SPLIT: datasets.Dataset.from_list(docs(name))}


def prodip_mc_bn(**_: object) -> dict[str, datasets.Dataset]:
    return _dataset("prodip_mc_bn")


def prodip_mc_en(**_: object) -> dict[str, datasets.Dataset]:
    return _dataset("prodip_mc_en")

"""The options of one prepare run, their validation, and --mix arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from training.fertility import (
    DEFAULT_BALANCE_RANGE,
    DEFAULT_FERTILITY_FLOOR,
    DEFAULT_FERTILITY_RATIO,
    GATE_NAMES,
)
from training.prepare.errors import PrepareError
from training.prepare.sources import TEXT_FIELD
from training.text import LANGUAGES

DATA_FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 1 << 26
DEFAULT_MAX_SENTENCES = 2_000_000
DEFAULT_EVAL_DOCS = 50_000


@dataclass
class Options:
    vocab_size: int | None = None  # None: DEFAULT_VOCAB_SIZE, or the --tokenizer's own size
    tokenizer: Path | None = None
    mix: dict[str, float] | None = None
    val_fraction: float = DEFAULT_VAL_FRACTION
    seed: int = 0
    force: bool = False
    strict: bool = False
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    workers: int | None = None  # None: all cores
    fertility_floor: float = DEFAULT_FERTILITY_FLOOR
    fertility_ratio: float = DEFAULT_FERTILITY_RATIO
    balance_range: tuple[float, float] = DEFAULT_BALANCE_RANGE
    skip_gates: list[str] = field(default_factory=list)
    text_field: str = TEXT_FIELD
    max_sentences: int = DEFAULT_MAX_SENTENCES
    eval_docs: int = DEFAULT_EVAL_DOCS
    progress: bool = True
    echo: bool = False  # print the fertility and gate tables (the CLI does)
    quality: Path | None = None  # quality.toml; None: the shipped one
    filters: bool = True  # quality rules
    dedup: bool = True  # exact + near-duplicate removal
    near_dedup: bool = True
    decontaminate: list[Path] = field(default_factory=list)  # eval sets beside the shipped one
    shipped_eval_sets: bool = True
    shard_index: int = 0
    num_shards: int = 1

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise PrepareError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise PrepareError(f"--vocab-size must be positive, got {self.vocab_size}")
        if self.shard_tokens < 1:
            raise PrepareError(f"--shard-tokens must be positive, got {self.shard_tokens}")
        if self.workers is not None and self.workers < 1:
            raise PrepareError(f"--workers must be >= 1, got {self.workers}")
        lo, hi = self.balance_range
        if not 0 < lo <= 1 <= hi:
            raise PrepareError(f"--balance-range must be LO,HI with 0 < LO <= 1 <= HI, got {lo},{hi}")
        unknown = [g for g in self.skip_gates if g not in GATE_NAMES]
        if unknown:
            raise PrepareError(f"--skip-gate: unknown gate {unknown[0]!r}; known gates: {', '.join(GATE_NAMES)}")
        if self.max_sentences < 1 or self.eval_docs < 1:
            raise PrepareError("--max-sentences and --eval-docs must be positive")
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise PrepareError(f"--shard-index must be in [0, --num-shards), got {self.shard_index} of {self.num_shards}")
        if self.num_shards > 1 and self.tokenizer is None:
            raise PrepareError("--num-shards needs --tokenizer FILE: every shard must encode with the same "
                               "tokenizer (train it first with one ordinary prepare run)")


def parse_mix(spec: str | dict[str, float] | None) -> dict[str, float] | None:
    """'bn=0.8,en=0.2' -> {'bn': 0.8, 'en': 0.2} (normalized to sum 1 over the named languages)."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        out: dict[str, float] = {}
        for part in spec.split(","):
            lang, sep, val = part.partition("=")
            try:
                out[lang.strip()] = float(val) if sep else float("nan")
            except ValueError:
                raise PrepareError(f"--mix: bad share {part!r}; expected e.g. bn=0.8,en=0.2") from None
    else:
        out = {str(k): float(v) for k, v in spec.items()}
    for lang, v in out.items():
        if lang not in LANGUAGES:
            raise PrepareError(f"--mix: unknown language {lang!r}; use {', '.join(LANGUAGES)}")
        if not v >= 0:
            raise PrepareError(f"--mix: share of {lang} must be a number >= 0, got {v}")
    total = sum(out.values())
    if total <= 0:
        raise PrepareError("--mix: shares must not all be zero")
    return {k: v / total for k, v in out.items()}


def mix_keep_probabilities(mix: dict[str, float], lang_chars: dict[str, int]) -> dict[str, float]:
    """Per-language keep probabilities so kept characters follow `mix` among the named languages.

    Keep the most text possible: the scarcest language (relative to its target) is kept whole,
    the others are down-sampled to match. Languages not named in the mix are kept whole.
    """
    for lang, share in mix.items():
        if share > 0 and lang_chars.get(lang, 0) == 0:
            raise PrepareError(f"--mix asks for {lang}={share:.2f} but the inputs hold no {lang} documents")
    total = min(lang_chars[lang] / share for lang, share in mix.items() if share > 0)
    return {lang: (share * total / lang_chars[lang] if lang_chars.get(lang) else 0.0) for lang, share in mix.items()}

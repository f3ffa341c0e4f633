"""The options of one prepare run, their validation, and --mix arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field

from training.prepare.cluster.worker_memory import DEFAULT_MEMORY_GB
from training.prepare.errors import PrepareError
from training.prepare.sources import TEXT_FIELD
from training.runfiles.file_ops import Input, check_apart
from training.runfiles.schema import (
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    SchemaError,
    Seed,
    check,
    one_of,
    parse,
)
from training.text.fertility import (
    DEFAULT_BALANCE_RANGE,
    DEFAULT_FERTILITY_FLOOR,
    DEFAULT_FERTILITY_RATIO,
    GATE_NAMES,
)
from training.text.normalization import LANGUAGES

DATA_FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 1 << 24  # 16 M tokens: the shard buffer fills (and stays bounded) early
DEFAULT_MAX_SENTENCES = 2_000_000
DEFAULT_EVAL_DOCS = 50_000
MIN_VOCAB_SIZE = 257  # byte fallback alone takes 256 pieces (SentencePiece says what more it needs)
MAX_VOCAB_SIZE = 1 << 20
VocabSize = Annotated[int, Field(ge=MIN_VOCAB_SIZE, le=MAX_VOCAB_SIZE)]
Fraction = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]  # a share strictly between none and all
# option -> (its flag, its schema type): the flags parse with these types and Options.validate checks with
# them, so the Python API (prepare(..., workers=0)) and the command line refuse the same values
OPTION_TYPES = {
    "vocab_size": ("--vocab-size", VocabSize), "val_fraction": ("--val-fraction", Fraction),
    "seed": ("--seed", Seed), "shard_tokens": ("--shard-tokens", PositiveInt), "workers": ("--workers", PositiveInt),
    "fertility_floor": ("--fertility-floor", NonNegFloat), "fertility_ratio": ("--fertility-ratio", NonNegFloat),
    "max_sentences": ("--max-sentences", PositiveInt), "eval_docs": ("--eval-docs", PositiveInt),
    "shard_index": ("--shard-index", NonNegInt), "num_shards": ("--num-shards", PositiveInt),
    "memory_gb": ("--memory-gb", PositiveFloat), "add_pieces": ("--add-pieces", PositiveInt),
}
OPTIONAL = {"vocab_size", "workers", "add_pieces"}  # None: the default (DEFAULT_VOCAB_SIZE or the tokenizer's; all cores)


@dataclass
class Options:
    vocab_size: int | None = None  # None: DEFAULT_VOCAB_SIZE, or the --tokenizer's own size
    tokenizer: Path | None = None
    extend_tokenizer: Path | None = None  # a base model's tokenizer.model to append pieces to (vocab_extend)
    add_pieces: int | None = None  # how many, with extend_tokenizer
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
    memory_gb: float = DEFAULT_MEMORY_GB  # main process + workers (training.prepare.cluster.worker_memory)

    def validate(self) -> None:
        """Every option against the schema type its flag has (OPTION_TYPES), then the cross-checks."""
        try:
            for name, (flag_, type_) in OPTION_TYPES.items():
                value = getattr(self, name)
                if value is not None or name not in OPTIONAL:
                    check(type_, value, flag_)
            for g in self.skip_gates:
                one_of("gate", g, GATE_NAMES)
        except SchemaError as e:
            raise PrepareError(str(e)) from None
        lo, hi = self.balance_range
        if not 0 < lo <= 1 <= hi:
            raise PrepareError(f"--balance-range must be LO,HI with 0 < LO <= 1 <= HI, got {lo},{hi}")
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise PrepareError(f"--shard-index must be in [0, --num-shards), got {self.shard_index} of {self.num_shards}")
        if (self.extend_tokenizer is None) != (self.add_pieces is None):
            raise PrepareError("--extend-tokenizer BASE and --add-pieces N go together")
        if self.extend_tokenizer is not None and (self.tokenizer is not None or self.vocab_size is not None):
            raise PrepareError("--extend-tokenizer sets the tokenizer (the base's pieces + --add-pieces): "
                               f"drop --{'tokenizer' if self.tokenizer is not None else 'vocab-size'}")
        if self.num_shards > 1 and self.tokenizer is None:
            raise PrepareError("--num-shards needs --tokenizer FILE: every shard must encode with the same "
                               "tokenizer (train it first with one ordinary prepare run)")


def check_places(inputs: Sequence[str], out: Path, opt: Options, shipped_eval: Sequence[Path] = ()) -> None:
    """--out apart from everything the run reads (training.runfiles.file_ops.check_apart): with --force the old DATA_DIR
    is deleted once the new one is in place, so an --out that is, holds or lies in an input would take
    the corpus (or the tokenizer, quality rules, eval sets) with it."""
    check_apart("--out", out, [*(Input("--input", i) for i in inputs), Input("--tokenizer", opt.tokenizer),
                               Input("--extend-tokenizer", opt.extend_tokenizer), Input("--quality", opt.quality),
                               *(Input("--decontaminate", d) for d in opt.decontaminate),
                               *(Input("the shipped eval set", p) for p in shipped_eval)], PrepareError)


MIX_SUM_SLACK = 1e-9  # decimal shares in binary floats: 0.7 + 0.2 + 0.1 is 0.9999999999999999


def parse_mix(spec: str | dict[str, float] | None) -> dict[str, float] | None:
    """'bn=0.8,en=0.2' -> {'bn': 0.8, 'en': 0.2}: shares in [0, 1] summing to at most 1, each language
    once (a share past 1 or a sum past 1 is a typo, refused by value); shares summing below 1 are
    relative among the named languages (bn=0.4,en=0.4 is bn=0.5,en=0.5), as docs/tokenizer.md says."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        out: dict[str, float] = {}
        for part in spec.split(","):
            lang, sep, val = part.partition("=")
            if not sep:
                raise PrepareError(f"--mix: bad share {part!r}; expected e.g. bn=0.8,en=0.2")
            if lang.strip() in out:
                raise PrepareError(f"--mix {spec}: {lang.strip()} is given twice; give each language once")
            out[lang.strip()] = val.strip()
    else:
        out = {str(k): str(v) for k, v in spec.items()}
    try:
        for lang in out:
            one_of("language", lang, LANGUAGES)
            out[lang] = parse(NonNegFloat, out[lang], f"share of {lang}")
    except SchemaError as e:
        raise PrepareError(f"--mix {spec}: {e}") from None
    total = sum(out.values())
    if total <= 0:
        raise PrepareError("--mix: shares must not all be zero")
    for lang, share in out.items():
        if share > 1:
            raise PrepareError(f"--mix {spec}: the share of {lang} is {share:g}; a share is at most 1")
    if total > 1 + MIX_SUM_SLACK:
        raise PrepareError(f"--mix {spec}: the shares sum to {total:g}; they must sum to at most 1")
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

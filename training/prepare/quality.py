"""Document quality rules (Gopher/FineWeb-style, adapted to Bangla), thresholds from a TOML file.

`QualityRules.load(path)` reads `[quality]` of quality.toml (the shipped defaults beside this
module, or the user's --quality FILE); `rules.check(doc)` returns the name of the first rule the
document breaks, or None. Each rule is a pure function of the normalized document, so the check
runs in the worker processes and its verdict does not depend on order or worker count.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

from training.prepare.errors import PrepareError
from training.runfiles.schema import NonNegInt, Probability, SchemaError, check, reject_unknown
from training.text.normalization import match_words, script_counts

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_QUALITY_TOML = Path(__file__).with_name("quality.toml")
_DELETE_PUNCT = {cp: None for cp in range(0x10000) if unicodedata.category(chr(cp))[0] in "PS"}
_DIGITS = re.compile(r"\d")  # Unicode decimal digits: ASCII 0-9 and Bangla ০-৯ alike


@dataclass(frozen=True)
class QualityRules:
    min_words: int = 3
    min_script_share: float = 0.8
    max_symbol_ratio: float = 0.25
    max_digit_ratio: float = 0.3
    max_dup_line_frac: float = 0.3
    max_dup_line_char_frac: float = 0.2
    ngram_min_words: int = 50
    max_top_2gram_frac: float = 0.2
    max_top_3gram_frac: float = 0.18
    max_top_4gram_frac: float = 0.16
    max_dup_5gram_frac: float = 0.15
    max_boilerplate_frac: float = 0.3
    boilerplate_max_line_words: int = 12
    boilerplate: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_table(cls, table: dict, where: str) -> QualityRules:
        if not isinstance(table, dict):
            raise PrepareError(f"{where}: [quality] must be a table, not {type(table).__name__}")
        try:
            reject_unknown("quality setting", table, [f.name for f in fields(cls)], where)
        except SchemaError as e:
            raise PrepareError(str(e)) from None
        vals = dict(table)
        if "boilerplate" in vals:
            if not isinstance(vals["boilerplate"], list) or not all(isinstance(s, str) for s in vals["boilerplate"]):
                raise PrepareError(f"{where}: quality.boilerplate must be a list of strings")
            vals["boilerplate"] = tuple(s.casefold() for s in vals["boilerplate"])
        counts = {f.name for f in fields(cls) if f.type == "int"}  # word counts; every other number is a share
        for k, v in vals.items():
            if k != "boilerplate":
                try:
                    check(NonNegInt if k in counts else Probability, v, f"{where}: quality.{k}", strict=True)
                except SchemaError as e:
                    raise PrepareError(str(e)) from None
        return cls(**vals)

    def to_dict(self) -> dict:
        return {f.name: (list(getattr(self, f.name)) if f.name == "boilerplate" else getattr(self, f.name))
                for f in fields(self)}

    def check(self, doc: str, words: list[str] | None = None, counts: dict[str, int] | None = None) -> str | None:
        """The first rule `doc` breaks, or None. `words`, `counts`: match_words(doc) and
        script_counts(doc) when the caller has them already."""
        words = match_words(doc) if words is None else words
        return (self._length(words) or self._script(counts or script_counts(doc)) or self._chars(doc)
                or self._lines(doc) or self._ngrams(words) or self._boilerplate(doc))

    # Each helper returns a rule name (the TOML key that failed) or None; a value < 0 turns it off.
    def _length(self, words: list[str]) -> str | None:
        return "min_words" if 0 <= len(words) < self.min_words else None

    def _script(self, c: dict[str, int]) -> str | None:
        letters = c["bn"] + c["en"] + c["other"]
        if self.min_script_share >= 0 and letters and (c["bn"] + c["en"]) / letters < self.min_script_share:
            return "min_script_share"
        return None

    def _chars(self, doc: str) -> str | None:
        n = sum(map(len, doc.split()))  # non-space characters
        if not n:
            return None
        symbols = len(doc) - len(doc.translate(_DELETE_PUNCT))
        if 0 <= self.max_symbol_ratio < symbols / n:
            return "max_symbol_ratio"
        if 0 <= self.max_digit_ratio < len(_DIGITS.findall(doc)) / n:
            return "max_digit_ratio"
        return None

    def _lines(self, doc: str) -> str | None:
        lines = [ln.strip() for ln in doc.split("\n") if ln.strip()]
        if len(lines) < 2:
            return None
        seen: set[str] = set()
        dup = dup_chars = 0
        for ln in lines:
            if ln in seen:
                dup += 1
                dup_chars += len(ln)
            seen.add(ln)
        if 0 <= self.max_dup_line_frac < dup / len(lines):
            return "max_dup_line_frac"
        if 0 <= self.max_dup_line_char_frac < dup_chars / sum(len(ln) for ln in lines):
            return "max_dup_line_char_frac"
        return None

    def _ngrams(self, words: list[str]) -> str | None:
        if len(words) < max(self.ngram_min_words, 5):
            return None
        total = sum(len(w) for w in words)
        for n, limit in ((2, self.max_top_2gram_frac), (3, self.max_top_3gram_frac), (4, self.max_top_4gram_frac)):
            if limit < 0:
                continue
            grams = Counter(zip(*(words[i:] for i in range(n))))
            gram, count = grams.most_common(1)[0]
            if count > 1 and count * sum(len(w) for w in gram) / total > limit:
                return f"max_top_{n}gram_frac"
        if self.max_dup_5gram_frac >= 0:
            grams5 = list(zip(*(words[i:] for i in range(5))))
            counts = Counter(grams5)
            covered = [False] * len(words)
            for i, g in enumerate(grams5):
                if counts[g] > 1:
                    covered[i:i + 5] = [True] * 5
            if sum(len(w) for w, c in zip(words, covered) if c) / total > self.max_dup_5gram_frac:
                return "max_dup_5gram_frac"
        return None

    def _boilerplate(self, doc: str) -> str | None:
        if self.max_boilerplate_frac < 0 or not self.boilerplate:
            return None
        lines = [ln for ln in doc.split("\n") if ln.strip()]
        bad = 0
        for ln in lines:
            if len(ln.split()) <= self.boilerplate_max_line_words:
                low = ln.casefold()
                bad += any(p in low for p in self.boilerplate)
        return "max_boilerplate_frac" if lines and bad / len(lines) > self.max_boilerplate_frac else None


@dataclass(frozen=True)
class PrepConfig:
    """Everything quality.toml holds: the quality rules and the dedup/decontamination settings."""

    quality: QualityRules
    dedup: dict
    decontam: dict
    path: str

    def to_dict(self) -> dict:
        return {"path": self.path, "quality": self.quality.to_dict(), "dedup": self.dedup, "decontam": self.decontam}


DEDUP_DEFAULTS = {"shingle_words": 5, "num_perm": 112, "bands": 14, "max_index_mb": 1024}
DECONTAM_DEFAULTS = {"ngram_words": 13, "min_words": 8}


def _section(data: dict, name: str, defaults: dict, where: str) -> dict:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise PrepareError(f"{where}: [{name}] must be a table, not {type(table).__name__}")
    try:
        reject_unknown(f"{name} setting", table, defaults, where)
    except SchemaError as e:
        raise PrepareError(str(e)) from None
    out = {**defaults, **table}
    for k, v in out.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PrepareError(f"{where}: {name}.{k} must be a positive integer, got {v!r}")
    return out


def load_config(path: str | Path | None = None) -> PrepConfig:
    """quality.toml (the shipped one when `path` is None) as a PrepConfig; PrepareError if invalid."""
    p = Path(path) if path is not None else DEFAULT_QUALITY_TOML
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PrepareError(f"--quality: file not found: {p}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PrepareError(f"--quality {p}: not valid TOML ({e})") from None
    try:
        reject_unknown("table", data, ("quality", "dedup", "decontam"), f"--quality {p}")
    except SchemaError as e:
        raise PrepareError(str(e)) from None
    dedup = _section(data, "dedup", DEDUP_DEFAULTS, str(p))
    if dedup["num_perm"] % dedup["bands"]:
        raise PrepareError(f"{p}: dedup.num_perm ({dedup['num_perm']}) must be a multiple of dedup.bands ({dedup['bands']})")
    return PrepConfig(QualityRules.from_table(data.get("quality", {}), str(p)), dedup,
                      _section(data, "decontam", DECONTAM_DEFAULTS, str(p)), str(p))

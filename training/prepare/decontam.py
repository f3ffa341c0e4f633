"""Decontamination: training documents that share a word n-gram with an evaluation text are removed.

Eval sets are the files given with --decontaminate (and the SFT set that ships in training/assets):
plain text (the held-out text of `training.evaluate --text`, one text per paragraph), JSONL or a
JSON list of records (multiple-choice sets in any of the formats training.evaluate reads, chat/SFT
records). Every string value of a record is an eval text, and so is all of them joined (so an
n-gram spanning question and answer counts). A chat file whose records name a held-out split
(test/validation/val/dev) contributes those records only; one without a split field contributes
all records, a superset of the held-out 5 % that training/sft.py picks by hash.

Matching is on `match_words` (case-folded, punctuation removed): any `ngram_words`-word sequence
(13, as in GPT-3's decontamination) of an eval text found in a training document removes that
document; an eval text of `min_words`..`ngram_words - 1` words must appear whole. The data report
records each set (path, sha256 of its normalized content, n-gram size, documents removed), and
`status_for(report, eval_path)` tells `training.evaluate` whether an eval file was checked.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.prepare.dedup import extend_ngrams, ngram_hashes, word_hashes
from training.prepare.errors import PrepareError
from training.runfiles.file_ops import expand_files
from training.runfiles.json_records import JSONBoundError, loads
from training.text.normalization import match_words, normalize

EVAL_TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".ndjson", ".tsv")  # what --decontaminate folders yield
HELD_OUT_SPLITS = ("test", "validation", "val", "dev")  # the splits training/sft.py holds out
_ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED_EVAL_SETS = (  # every evaluation text that ships with prodip: checked unless --no-shipped-eval
    _ASSETS / "chat" / "prodip_chat_bn.jsonl",
    _ASSETS / "eval" / "heldout_bn.txt",
    _ASSETS / "eval" / "prodip_mc_bn.jsonl",
    _ASSETS / "eval" / "prodip_mc_en.jsonl",
)
DECONTAMINATED, NOT_CHECKED = "decontaminated", "not checked"


def content_sha256(path: str | Path) -> str:
    """sha256 of a file's normalized text: the same eval set under another path or line ending matches."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise PrepareError(f"--decontaminate: cannot read {path}: {e.strerror or e}") from None
    return hashlib.sha256(normalize(raw.decode("utf-8", errors="replace")).encode("utf-8")).hexdigest()


def json_strings(obj: object) -> Iterator[str]:
    """Every string inside a parsed JSON value (the text of a chat or multiple-choice record)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from json_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from json_strings(v)


def _records(path: Path) -> list:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = loads(stripped)  # the one bounded reader (training.runfiles.json_records): depth, valid Unicode
        return data if isinstance(data, list) else [data]
    return [loads(line) for line in text.splitlines() if line.strip()]


def eval_texts(path: Path) -> tuple[list[str], str]:
    """The eval texts of one file and how they were taken (for the report)."""
    try:
        if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
            recs = _records(path)
            splits = [r.get("split") for r in recs if isinstance(r, dict)]
            if any(s in HELD_OUT_SPLITS for s in splits):
                recs = [r for r in recs if isinstance(r, dict) and r.get("split") in HELD_OUT_SPLITS]
                how = f"{len(recs)} held-out records (split field)"
            else:
                how = f"{len(recs)} records"
            texts: list[str] = []
            for r in recs:
                parts = [s for s in json_strings(r.get("messages", r) if isinstance(r, dict) else r)
                         if len(s.split()) > 1]
                texts.extend(parts)
                texts.append(" ".join(parts))
            return texts, how
        paras = [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        return paras, f"{len(paras)} paragraphs"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, JSONBoundError) as e:
        raise PrepareError(f"--decontaminate {path}: not readable as text/JSON/JSONL ({e})") from None


def resolve_eval_paths(paths: Sequence[str | Path], shipped: bool = True) -> list[Path]:
    out = [p for p in SHIPPED_EVAL_SETS if p.is_file()] if shipped else []
    out += expand_files(paths, PrepareError, what="--decontaminate", suffixes=EVAL_TEXT_SUFFIXES)
    seen: set[Path] = set()
    return [p for p in out if not (p.resolve() in seen or seen.add(p.resolve()))]


@dataclass
class EvalIndex:
    """Sorted n-gram hashes of every eval text, per n-gram length, with the set each came from."""

    lengths: list[int]
    hashes: dict[int, np.ndarray]  # n -> sorted uint64
    owners: dict[int, np.ndarray]  # n -> int32 index into sets, aligned with hashes
    sets: list[dict]

    @classmethod
    def build(cls, paths: Sequence[Path], ngram_words: int, min_words: int) -> EvalIndex:
        grams: dict[int, list[tuple[np.ndarray, int]]] = {}
        sets = []
        for i, path in enumerate(paths):
            texts, how = eval_texts(path)
            n_grams = 0
            for t in texts:
                words = match_words(normalize(t))
                if len(words) < min_words:
                    continue
                n = min(ngram_words, len(words))
                h = ngram_hashes(word_hashes(words), n)
                grams.setdefault(n, []).append((h, i))
                n_grams += h.size
            sets.append({"path": str(path), "sha256": content_sha256(path), "texts": how,
                         "ngram_words": ngram_words, "min_words": min_words, "ngrams": n_grams,
                         "documents_removed": 0})
        hashes, owners = {}, {}
        for n, parts in grams.items():
            h = np.concatenate([p for p, _ in parts])
            o = np.concatenate([np.full(p.size, i, dtype=np.int32) for p, i in parts])
            order = np.argsort(h, kind="stable")
            hashes[n], owners[n] = h[order], o[order]
        return cls(sorted(hashes), hashes, owners, sets)

    def match(self, w: np.ndarray) -> int | None:
        """Index of the first eval set sharing an n-gram with a document (its word hashes `w`), or None."""
        if not self.lengths or w.size < self.lengths[0]:
            return None
        n = self.lengths[0]
        acc = ngram_hashes(w, n)
        while True:
            if n in self.hashes:
                table = self.hashes[n]
                pos = np.searchsorted(table, acc)
                pos[pos == table.size] = 0
                hit = table[pos] == acc
                if hit.any():
                    return int(self.owners[n][pos[np.argmax(hit)]])
            if n >= self.lengths[-1] or acc.size < 2:
                return None
            acc = extend_ngrams(acc, w, n)
            n += 1


def status_for(data_report: dict, eval_path: str | Path) -> str:
    """'decontaminated' when the data report's decontamination checked this eval file (matched by
    the sha256 of its normalized content), else 'not checked'. Torch-free, for training.evaluate."""
    sets = (data_report.get("decontamination") or {}).get("sets") or []
    try:
        sha = content_sha256(eval_path)
    except PrepareError:
        return NOT_CHECKED
    return DECONTAMINATED if any(s.get("sha256") == sha for s in sets) else NOT_CHECKED

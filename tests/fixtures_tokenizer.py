"""Helpers for the tokenizer/prepare tests: small deterministic corpora from training/assets, and where
the opt-in shared data is."""

from __future__ import annotations

from pathlib import Path

from conftest import CORPUS, ORTHOGRAPHY

# Files of both registers, chosen to contain both spellings of the nukta letters (checked in test_text).
BN_FILES = ("bn/train/majantali_bnarchive/RabindranathTagore_Prose_GalpaGuchchha_1.md",
            "bn/train/majantali_bnarchive_wip/RabindranathTagore_Prose_NaukaaDubi.md",
            "bn/train/7shi_bou_thakuranir_haat_all_bn.md",
            "bn/train/majantali_bnarchive/SukumarRay_Prose_PaglaDashu.md")
EN_FILES = ("en/train/gutenberg/Great-Expectations_1400__1400-0.txt",
            "en/train/gutenberg/Frankenstein_84__84-0.txt",
            "en/train/tinyshakespeare_input.txt")


def shipped_lines() -> list[str]:
    """Every non-empty line of the shipped plain text: corpus, held-out eval text, calibration text and
    the (un-normalized) orthography file."""
    files = [*sorted(CORPUS.glob("*.txt")), *sorted(CORPUS.parent.glob("[ec]*/*.txt")), ORTHOGRAPHY]
    return [ln for f in files for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]


def head_paragraphs(path: Path, max_bytes: int, skip_bytes: int = 0) -> str:
    """Whole blank-line paragraphs from `path`, starting after `skip_bytes`, up to `max_bytes`."""
    paras = path.read_text(encoding="utf-8").split("\n\n")
    out, size, seen = [], 0, 0
    for p in paras:
        seen += len(p.encode("utf-8")) + 2
        if seen <= skip_bytes:
            continue
        if size + len(p.encode("utf-8")) > max_bytes:
            break
        out.append(p)
        size += len(p.encode("utf-8")) + 2
    return "\n\n".join(out) + "\n"


def write_subset(folder: Path, bytes_per_language: int) -> Path:
    """A two-language corpus (bn/*.txt, en/*.txt) from the text that ships in training/assets: the
    same bytes every time, on every clone. At most `bytes_per_language` of each language."""
    for lang in ("bn", "en"):
        (folder / lang).mkdir(parents=True, exist_ok=True)
        files = sorted(CORPUS.glob(f"{lang}_*.txt"))
        per_file = bytes_per_language // len(files)
        for src in files:
            text = head_paragraphs(src, per_file)
            (folder / lang / src.name).write_text(text, encoding="utf-8")
    return folder

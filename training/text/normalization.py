"""normalize(): the one canonical text form for Bangla and English, used by every stage.

Canonical form is Unicode NFC, plus three cleanups. Why NFC:
- It is the form the W3C and most input methods produce, and it is *stable*: NFC(NFC(x)) == NFC(x)
  under every future Unicode version, so ids trained today match text typed years from now.
- It unifies the two spellings of the nukta letters found in real Bangla text. U+09DC/09DD/09DF
  (ড় ঢ় য়) are composition exclusions, so NFC maps the precomposed letters to their decomposed
  pairs (ড/ঢ/য + U+09BC nukta); both spellings then give identical token ids.
- It composes the two-part vowel signs (ে + া → ো U+09CB, ে + ৗ → ৌ U+09CC) consistently.
- Unlike NFKC it folds nothing semantic: ZWJ/ZWNJ (which select conjunct/ya-phala shapes in
  Bangla) survive, and so do full-width forms and ligatures a user typed on purpose.

The cleanups: a byte-order mark (U+FEFF) anywhere is dropped; CRLF and lone CR become LF. Other
whitespace (runs of spaces, tabs, newlines) is kept exactly, because llama.cpp keeps it too and
the tokenizer has whitespace pieces for it.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

BOM = "\ufeff"
ZWNJ = "\u200c"
ZWJ = "\u200d"
NUKTA = "\u09bc"
NORMAL_FORM = "NFC"


def normalize(text: str) -> str:
    """Return the canonical form of `text` (idempotent: normalize(normalize(x)) == normalize(x))."""
    if BOM in text:
        text = text.replace(BOM, "")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return unicodedata.normalize(NORMAL_FORM, text)


def is_normalized(text: str) -> bool:
    return BOM not in text and "\r" not in text and unicodedata.is_normalized(NORMAL_FORM, text)


# Script classification (for fertility/balance reports), by Unicode block.
def script_counts(text: str) -> dict[str, int]:
    """Count letters by script: 'bn' (Bengali block), 'en' (ASCII letters), 'other' (other letters)."""
    bn = en = other = 0
    for ch in text:
        o = ord(ch)
        if 0x0980 <= o <= 0x09FF:
            bn += 1
        elif ch.isascii():
            if ch.isalpha():
                en += 1
        elif ch.isalpha():
            other += 1
    return {"bn": bn, "en": en, "other": other}


LANGUAGES = ("bn", "en", "other")


def detect_language(text: str, threshold: float = 0.6) -> str:
    """'bn' or 'en' when that script holds >= threshold of the letters, else 'other' (mixed/other)."""
    return language_of_counts(script_counts(text), threshold)


def language_of_counts(c: dict[str, int], threshold: float = 0.6) -> str:
    """detect_language from script_counts already taken (the data pipeline counts once per document)."""
    total = sum(c.values())
    if total == 0:
        return "other"
    for lang in ("bn", "en"):
        if c[lang] / total >= threshold:
            return lang
    return "other"


_SURROGATE = re.compile("[\ud800-\udfff]")


def first_surrogate(text: str) -> int | None:
    """Where `text` holds a lone surrogate (U+D800..U+DFFF), else None. A surrogate is no character:
    JSON's "\\ud800" escape and Python's surrogateescape (non-UTF-8 bytes in a path or an argument)
    both smuggle one into a str, and every writer (UTF-8, sentencepiece) then fails on it."""
    if text.isascii():
        return None
    m = _SURROGATE.search(text)
    return m.start() if m else None


def check_text(text: str, what: str, error: type[Exception] = ValueError) -> str:
    """The one text check at an input boundary: `text` itself, or `error` naming `what` and the first
    code point that is not valid Unicode (a str decoded from UTF-8 holds none; JSON escapes can)."""
    pos = first_surrogate(text)
    if pos is not None:
        raise error(f"{what}: not valid Unicode text (a lone surrogate U+{ord(text[pos]):04X} at "
                    f"character {pos}; JSON escapes like \\ud800 must come in pairs)")
    return text


def check_arg(text: str, what: str, error: type[Exception] = ValueError) -> str:
    """A command-line argument or path: `error` naming it when it holds bytes that are not UTF-8
    (Python keeps them as surrogates U+DC80..U+DCFF; every later print or write would crash)."""
    pos = first_surrogate(text)
    if pos is not None:
        cp = ord(text[pos])
        byte = f"byte 0x{cp - 0xDC00:02x}" if 0xDC80 <= cp <= 0xDCFF else f"U+{cp:04X}"
        try:  # the bytes as given, undecodable ones as \\xff
            shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            shown = text.encode("utf-8", "backslashreplace").decode("utf-8")
        raise error(f"{what} '{shown}': not UTF-8 ({byte} at character {pos}); rename it or pass UTF-8 text")
    return text


def read_utf8(path: str | Path, what: str, error: type[Exception] = ValueError) -> str:
    """The text of `path`, or `error` with one clear line when it is missing or not UTF-8."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} not found: {p}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text ({e})") from None


# Words for matching (deduplication, decontamination, repetition rules): case-folded, with
# punctuation and symbols (Unicode categories P*, S*, the danda included) turned into spaces.
# Combining marks stay inside their word: Bangla vowel signs and the virama are not letters, so a
# regex \w+ would cut Bangla words apart.
_PUNCT_TO_SPACE = {cp: " " for cp in range(0x10000) if unicodedata.category(chr(cp))[0] in "PS"}


def match_words(text: str) -> list[str]:
    """The words of `text` for comparing documents: case-folded, punctuation and symbols removed."""
    return text.casefold().translate(_PUNCT_TO_SPACE).split()

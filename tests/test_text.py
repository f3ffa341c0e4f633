"""training.text.normalization: the one normalization (NFC + BOM/CR cleanup) and the script-based language detection."""

from __future__ import annotations

import unicodedata

import pytest
from conftest import ORTHOGRAPHY, TATOEBA, shared_path
from fixtures_tokenizer import BN_FILES, shipped_lines

from training.text.normalization import (
    BOM,
    NUKTA,
    ZWJ,
    ZWNJ,
    detect_language,
    is_normalized,
    language_of_counts,
    match_words,
    normalize,
    script_counts,
)

PRECOMPOSED = {"\u09dc": "\u09a1", "\u09dd": "\u09a2", "\u09df": "\u09af"}  # ড় ঢ় য় -> base letter (+ nukta)


@pytest.mark.parametrize("pre,base", PRECOMPOSED.items())
def test_precomposed_nukta_letters_become_the_decomposed_pair(pre, base):
    word_pre, word_dec = f"ব{pre}া", f"ব{base}{NUKTA}া"
    assert normalize(word_pre) == normalize(word_dec) == word_dec
    assert is_normalized(word_dec) and not is_normalized(word_pre)


def test_two_part_vowel_signs_compose():
    assert normalize("ক\u09c7\u09be") == "ক\u09cb"  # ে + া -> ো
    assert normalize("ক\u09c7\u09d7") == "ক\u09cc"  # ে + ৗ -> ৌ


def test_zwj_zwnj_whitespace_and_fullwidth_survive():
    for s in (f"র{ZWJ}্যাব", f"ক্{ZWNJ}ষ", "a  b\t\tc\n\n d ", "ＡＢＣ ﬁ", "  leading"):
        assert normalize(s) == s


def test_bom_and_carriage_returns_are_cleaned():
    assert normalize(f"{BOM}আমি\r\nতুমি\rসে{BOM}") == "আমি\nতুমি\nসে"
    assert not is_normalized("a\r\nb") and not is_normalized(BOM + "a")


@pytest.mark.parametrize("source", ["shipped", "tatoeba"])
def test_idempotent_and_stable_on_real_text(source):
    """On every clone: the shipped text; opt-in breadth: Tatoeba's 5,120 lines."""
    lines = (shipped_lines() if source == "shipped"
             else shared_path(*TATOEBA).read_text(encoding="utf-8").splitlines())
    for line in lines:
        n = normalize(line)
        assert normalize(n) == n and is_normalized(n)
        assert unicodedata.is_normalized("NFC", n)
        assert n.count(ZWJ) == line.count(ZWJ) and n.count(ZWNJ) == line.count(ZWNJ)


@pytest.mark.parametrize("source", ["shipped", "shared"])
def test_files_with_either_spelling_agree_after_normalize(source):
    """Text mixing U+09DC/09DD/09DF and base+nukta: after normalize only the pair remains. On every
    clone the shipped orthography file; opt-in breadth: the shared literature and Tatoeba."""
    if source == "shipped":
        texts, least = [ORTHOGRAPHY.read_text(encoding="utf-8")], 10
    else:
        texts = [shared_path(*rel.split("/")).read_text(encoding="utf-8") for rel in BN_FILES] + [shared_path(*TATOEBA).read_text(encoding="utf-8")]
        least = 1000
    raw_pre = sum(t.count(c) for t in texts for c in PRECOMPOSED)
    raw_nukta = sum(t.count(NUKTA) for t in texts)
    assert raw_pre > least and raw_nukta > least, "fixture files should hold both spellings"
    normed = [normalize(t) for t in texts]
    assert sum(t.count(c) for t in normed for c in PRECOMPOSED) == 0
    assert sum(t.count(NUKTA) for t in normed) == raw_pre + raw_nukta


def test_script_counts_and_detect_language():
    assert script_counts("আমি ভাত খাই, I eat 😀 Ωmega") == {"bn": 9, "en": 8, "other": 1}
    assert detect_language("আমি বাংলায় কথা বলি।") == "bn"
    assert detect_language("The quick brown fox.") == "en"
    assert detect_language("আমি খাই and you") == "other"  # 6 bn vs 6 en letters: neither reaches 60%
    assert detect_language("12345 ... !!!") == "other"
    assert detect_language("") == "other"
    assert detect_language("Привет мир") == "other"
    assert detect_language("আমি খাই and you", threshold=0.5) == "bn"


def test_match_words_keeps_bangla_words_whole_and_drops_punctuation():
    """Vowel signs, virama and ZWNJ stay inside their word (a regex \\w+ would cut them apart); the
    danda, quotes and dashes go; case is folded, so "Dhaka" and "DHAKA" match."""
    text = normalize("ক্ষুধার্ত মানুষ—“বাংলাদেশ” র‌্যাব। Dhaka, DHAKA! ৩৫টি")
    assert match_words(text) == ["ক্ষুধার্ত", "মানুষ", "বাংলাদেশ", normalize("র‌্যাব"), "dhaka", "dhaka", "৩৫টি"]
    assert match_words("।।  — …") == []


def test_language_of_counts_is_detect_language():
    for text in ("আমি বাংলায় কথা বলি", "plain English text", "यह हिंदी है", "mixed বাংলা and English", ""):
        assert language_of_counts(script_counts(text)) == detect_language(text)

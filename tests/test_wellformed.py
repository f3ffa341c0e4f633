"""Bengali well-formedness: hand-checked clusters, the issue's broken answer, and every shipped text."""

from __future__ import annotations

import json

import pytest
from conftest import ASSETS, ORTHOGRAPHY

from training.text.normalization import normalize
from training.text.wellformed import clusters, wellformed

ISSUE_ANSWER = "বাংলাা্রসী বড় প্রাো, আর এব্যত।"  # the quickstart model's answer in issue 19


def _split(text: str) -> list[tuple[str, bool]]:
    return [(c.text, c.valid) for c in clusters(text)]


def test_issue_answer_is_below_100_percent_and_names_the_bad_clusters():
    wf = wellformed(ISSUE_ANSWER)
    # বাং লাা্ র সী | ব ড় | প্রাো | আ র | এ ব্য ত : 12 clusters, 2 broken
    assert (wf.clusters, wf.valid) == (12, 10)
    assert wf.share == pytest.approx(10 / 12)
    assert dict(wf.invalid) == {"লাা্": 1, "প্রাো": 1}
    assert wf.to_dict()["examples"] == ["লাা্", "প্রাো"]


@pytest.mark.parametrize("text, expected", [
    ("ক্ষমা", [("ক্ষ", True), ("মা", True)]),
    ("স্ত্রী", [("স্ত্রী", True)]),  # three consonants, one vowel sign
    ("চাঁদ", [("চাঁ", True), ("দ", True)]),  # vowel sign, then candrabindu
    ("উৎস", [("উ", True), ("ৎ", True), ("স", True)]),
    ("অ্যাপ", [("অ্যা", True), ("প", True)]),  # ya-phala on অ in loanwords
    ("ড\u09bcা", [("ড\u09bcা", True)]),  # base + nukta, then a vowel sign
    ("ক\u09c7\u09be", [("ক\u09c7\u09be", True)]),  # ো in its two-part (not NFC-composed) spelling
    ("র\u200d্যাব", [("র\u200d্যা", True), ("ব", True)]),  # ZWJ before the virama
    ("ক্\u200cষ", [("ক্\u200cষ", True)]),  # ZWNJ after the virama
    ("কিু", [("কিু", False)]),  # two vowel signs in a row
    ("আা", [("আা", False)]),  # a vowel sign on an independent vowel
    ("া বই", [("া", False), ("ব", True), ("ই", True)]),  # a vowel sign with no base at all
    ("ক\u200cখ", [("ক\u200c", False), ("খ", True)]),  # a joiner without a virama
    ("কা্", [("কা্", False)]),  # a virama after a vowel sign
    ("ক\u09bc\u09bc", [("ক\u09bc\u09bc", False)]),  # two nuktas
    ("ৎা", [("ৎা", False)]),  # khanda ta takes no vowel sign
    ("সঁঁজ", [("সঁঁ", False), ("জ", True)]),  # one candrabindu/anusvara/visarga per cluster
])
def test_clusters_by_hand(text, expected):
    assert _split(text) == expected


def test_digits_punctuation_and_other_scripts_are_not_counted():
    wf = wellformed("১২৩ ৳ 456, hello। \u200cمی\u200cخواهم")
    assert wf.clusters == 0 and wf.share == 1.0


def test_many_texts_add_up():
    wf = wellformed([ISSUE_ANSWER, "আমি ভাত খাই।"])
    assert (wf.clusters, wf.valid) == (12 + 6, 10 + 6)


def _shipped_texts():
    for p in sorted(ASSETS.rglob("*")):
        if p.suffix == ".txt":
            yield p, p.read_text(encoding="utf-8")
        elif p.suffix == ".jsonl":  # records: the strings inside, not the JSON escapes
            recs = [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
            yield p, json.dumps(recs, ensure_ascii=False)


def test_every_shipped_text_is_well_formed():
    """All of training/assets is written by people: every Bengali cluster in it must pass, normalized or
    not (orthography_bn.txt is deliberately un-normalized: both nukta spellings, ZWJ/ZWNJ)."""
    seen = 0
    for path, text in _shipped_texts():
        for t in (text, normalize(text)):
            wf = wellformed(t)
            assert wf.share == 1.0, f"{path}: {wf.to_dict()}"
        seen += wf.clusters
    assert seen > 30_000  # the corpus, chat set and eval sets were really read
    assert wellformed(ORTHOGRAPHY.read_text(encoding="utf-8")).clusters > 300

"""training.prepare's cleaning: planted failures are each caught by name and removed, and the data
report says what was removed and why (quality rules, exact/near duplicates, decontamination).

Builds only on training/assets: the shipped corpus plus planted documents written here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import CORPUS

from training.data.loaders import decoded_documents
from training.prepare import PrepareError, iter_file_docs, prepare, resolve_inputs, status_for
from training.prepare.dedup import U64Set, band_keys, word_hashes
from training.prepare.quality import load_config
from training.text.normalization import detect_language, match_words

FAST = {"workers": 1, "progress": False}
VOCAB = 2048
FLOOR = 1.5  # the shipped corpus is small: a 2k tokenizer reaches ~2.5 Bangla chars/token on it
# An eval item written for this test (a multiple-choice question in llm-foundry's format).
EVAL_QUERY = ("নদীর ধারে দাঁড়িয়ে ছোট্ট মিতা গুনে দেখল সাতটি নৌকা পাল তুলে উত্তরের দিকে যাচ্ছে আর "
              "তিনটি নৌকা ঘাটে বাঁধা আছে, তাহলে মোট কয়টি নৌকা সে দেখল")
HINDI = ("यह अनुच्छेद जानबूझकर गलत लिपि में लिखा गया है ताकि जाँचा जा सके कि बांग्ला कॉर्पस से "
         "दूसरी लिपि के दस्तावेज़ हटाए जाते हैं और रिपोर्ट में उनका कारण दिखाई देता है।")


def long_docs(n: int, min_words: int = 70) -> list[str]:
    """The first `n` shipped Bangla paragraphs with at least `min_words` words (near-dup detection
    is reliable on long documents: one changed word leaves 5-gram Jaccard similarity > 0.85)."""
    out = [d for f in resolve_inputs([CORPUS]) for d in iter_file_docs(f)
           if len(d.split()) >= min_words and detect_language(d) == "bn"]
    assert len(out) >= n, "the shipped corpus lost its long paragraphs"
    return out[:n]


def change_one_word(doc: str) -> str:
    words = doc.split(" ")
    i = len(words) // 2
    words[i] = "পরিবর্তিত" if words[i] != "পরিবর্তিত" else "বদলানো"
    return " ".join(words)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "data"
    prepare([CORPUS], out, vocab_size=VOCAB, fertility_floor=FLOOR, **FAST)
    return out / "tokenizer.model"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("planted")
    a, b = long_docs(2)
    mojibake = b.encode("utf-8").decode("latin-1")  # Bangla read as Latin-1: a classic mis-scripted file
    host = f"আজকের পাঠ শুরু হলো একটি ধাঁধা দিয়ে। {EVAL_QUERY}? সবাই খাতায় উত্তর লিখল এবং তারপর গল্প শুরু হলো।"
    docs = {"exact": "  " + a.replace(" ", "  ", 3) + "\n", "near": change_one_word(b), "eval": host,
            "hindi": HINDI, "mojibake": mojibake}
    (root / "planted.txt").write_text("\n\n".join(docs.values()) + "\n", encoding="utf-8")
    evals = root / "eval"
    evals.mkdir()
    (evals / "mc.jsonl").write_text(json.dumps({"query": EVAL_QUERY, "choices": ["সাতটি", "দশটি", "তিনটি"],
                                                "gold": 1}, ensure_ascii=False) + "\n", encoding="utf-8")
    (root / "other_eval.txt").write_text("এই ফাইলটি কোনো ডেটা রিপোর্টে পরীক্ষা করা হয়নি।\n", encoding="utf-8")
    return {"root": root, "docs": docs, "originals": (a, b), "evals": evals}


@pytest.fixture(scope="module")
def cleaned(planted, tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "data"
    prepare([CORPUS, planted["root"] / "planted.txt"], out, tokenizer=tokenizer, fertility_floor=FLOOR,
            decontaminate=[planted["evals"]], **FAST)
    return out


def decoded_docs(data: Path) -> list[str]:
    return [d for split in ("train", "val") for d in decoded_documents(data, split)]


def test_planted_failures_are_caught_by_name(cleaned, planted):
    report = json.loads((cleaned / "report.json").read_text())
    by = report["documents"]["dropped_by_reason"]
    assert by.get("exact_duplicate", 0) >= 1, by
    assert by.get("near_duplicate", 0) >= 1, by
    assert by.get("contaminated", 0) >= 1, by
    assert by.get("min_script_share", 0) >= 2, by  # Devanagari and mojibake
    kept = decoded_docs(cleaned)
    text = "\n".join(kept)
    assert EVAL_QUERY not in text and "यह अनुच्छेद" not in text and "à¦" not in text
    assert planted["docs"]["near"] not in kept
    a, b = planted["originals"]
    assert kept.count(a) == 1 and kept.count(b) == 1, "the first copy of a duplicate must stay"
    # Each planted document shows up as an example under its reason.
    md = (cleaned / "report.md").read_text()
    for reason in ("exact_duplicate", "near_duplicate", "contaminated", "min_script_share"):
        assert f"| {reason} |" in md
    assert "`min_script_share`: यह अनुच्छेद" in md


def test_decontamination_section_and_status_for(cleaned, planted):
    report = json.loads((cleaned / "report.json").read_text())
    dc = report["decontamination"]
    mc = [s for s in dc["sets"] if s["path"].endswith("mc.jsonl")]
    assert len(mc) == 1 and mc[0]["documents_removed"] == 1 and mc[0]["ngram_words"] == 13
    assert len(mc[0]["sha256"]) == 64
    assert any(EVAL_QUERY[:40] in r["snippet"] for r in dc["removed"])
    assert any(s["path"].endswith("prodip_chat_bn.jsonl") for s in dc["sets"])  # the shipped SFT set
    # The same eval content under another name and line endings is recognized; another file is not.
    copy = planted["root"] / "renamed.jsonl"
    copy.write_bytes((planted["evals"] / "mc.jsonl").read_bytes().replace(b"\n", b"\r\n"))
    assert status_for(report, copy) == "decontaminated"
    assert status_for(report, planted["root"] / "other_eval.txt") == "not checked"
    assert status_for({}, copy) == "not checked"


def test_cleaning_can_be_turned_off_and_rules_are_data(planted, tokenizer, tmp_path):
    """--no-filters/--no-dedup keep everything; a user TOML changes a threshold and the verdicts."""
    out = tmp_path / "raw"
    prepare([planted["root"] / "planted.txt", CORPUS], out, tokenizer=tokenizer, fertility_floor=FLOOR,
            filters=False, dedup=False, shipped_eval_sets=False, **FAST)
    assert json.loads((out / "report.json").read_text())["documents"]["dropped"] == 0
    toml = tmp_path / "q.toml"
    toml.write_text("[quality]\nmin_words = 40\nmin_script_share = 0\n", encoding="utf-8")  # 0: rule off
    cfg = load_config(toml)
    assert cfg.quality.check(HINDI) == "min_words" and cfg.quality.check(" ".join(["শব্দ"] * 10)) == "min_words"
    assert cfg.dedup["bands"] == 14  # sections not given keep their defaults
    toml.write_text("[quality]\nmin_wordz = 4\n", encoding="utf-8")
    with pytest.raises(PrepareError, match="min_wordz"):
        load_config(toml)


def test_quality_rules_on_constructed_documents():
    q = load_config().quality
    prose = " ".join(long_docs(1)[0].split()[:80])
    assert q.check(prose) is None
    assert q.check("শুধু দুই") == "min_words"
    assert q.check(HINDI) == "min_script_share"
    assert q.check("৳ ১২০ ৳ ১৩০ ৳ ১৪০ ৳ ১৫০ ৳ ১৬০ ৳ ১৭০") in ("max_symbol_ratio", "max_digit_ratio")
    assert q.check("দাম ১২৩৪৫ ৬৭৮৯০ ১২৩৪৫ ৬৭৮৯০ টাকা") == "max_digit_ratio"
    assert q.check("\n".join(["আজকের খবর পড়ুন এখানে"] * 3 + ["একটি আলাদা লাইন আছে এখানে"])) == "max_dup_line_frac"
    spam = " ".join(["সস্তা দামে মোবাইল কিনুন"] * 20)
    assert q.check(spam) == "max_top_2gram_frac"
    boiler = "মূল খবরের একটি লাইন এখানে লেখা\nশেয়ার করুন\nসর্বস্বত্ব সংরক্ষিত © ২০২৪\nআরও পড়ুন"
    assert q.check(boiler) == "max_boilerplate_frac"


def test_near_duplicate_signatures_and_fixed_table():
    doc = long_docs(1)[0]
    kw = {"shingle_words": 5, "num_perm": 112, "bands": 14, "seed": 0}
    a = band_keys(word_hashes(match_words(doc)), **kw)
    b = band_keys(word_hashes(match_words(change_one_word(doc))), **kw)
    c = band_keys(word_hashes(match_words(long_docs(2)[1])), **kw)
    assert (a == b).sum() >= 3 and not (a == c).any()
    s = U64Set(200_000)
    keys = np.random.default_rng(0).integers(0, 2**63, 200_000, dtype=np.uint64)
    s.add(keys[:100_000])
    assert s.contains(keys[:100_000]).all() and not s.contains(keys[100_000:]).any()
    assert s.size == 100_000 and s.nbytes == 200_000 * 8  # a fixed table: it never grows
    with pytest.raises(ValueError, match="full"):
        s.add(keys[100_000:])  # 200,000 keys exceed 0.75 x 200,000 slots: refused, not grown

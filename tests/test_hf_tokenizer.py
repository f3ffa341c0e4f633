"""tokenizer.json: AutoTokenizer on the HF export's tokenizer files gives exactly training's ids on raw
text (no normalize() by the caller), on every shipped text, the hard cases, and Tatoeba (opt-in); its
normalizer is training.text.normalization.normalize; decoding round-trips; the chat template tokenizes as ours."""

from __future__ import annotations

import json
import os
import random
import unicodedata
from pathlib import Path

import pytest
from conftest import ASSETS, ORTHOGRAPHY, TATOEBA, shared_path

from export.hf.hf_export import FAST_CLASS, write_tokenizer
from export.hf.hf_tokenizer import build, normalizer
from training.prepare.decontam import json_strings
from training.text import chat_template as chat
from training.text.chat_template import render
from training.text.normalization import BOM, NUKTA, ZWJ, ZWNJ, normalize
from training.text.tokenizer import BOS, CHAT_SPECIALS, EOS, PAD, UNK, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MAX_LEN = 256
TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
MIN_SHIPPED = 2000  # lines + strings + whole files in training/assets; fewer means the collector broke
RANDOM_STRINGS, RANDOM_LEN, SEED = 3000, 40, 0

# The cases the issue names, each spelled the ways real text spells it.
HARD_CASES = [
    "বড় \u09a1\u09bc \u09dc", "আষাঢ় \u09a2\u09bc \u09dd", "সময় \u09af\u09bc \u09df",  # ড় ঢ় য়: precomposed and nukta
    "\u09dc\u09dd\u09df\u09a1\u09bc\u09a2\u09bc\u09af\u09bc",
    f"ক্{ZWJ}ষ র{ZWNJ}্য জ্{ZWNJ}ঞ {ZWJ}{ZWNJ}",  # conjunct/ya-phala selectors survive
    "কে\u09be কে\u09d7 \u09cb \u09cc",  # two-part vowel signs composed by NFC
    "a  b   c\t\td \t \n\n\n  e   ",  # whitespace runs, tabs, newlines
    "line one\r\nline two\rline three\n", f"{BOM}শুরু মাঝে{BOM}শেষ",  # CRLF, lone CR, BOMs
    "১২৩৪৫৬৭৮৯০ 1234567890 3.14 ২০২৬-১২-০১", "The quick brown fox, don't stop! (ok) [x] {y}",
    "বাংলা and English মিশিয়ে code-switch করা", "😀 漢字 हिन्दी ৺ ৻ ﷽ \u0301 e\u0301",  # byte fallback
    "ব\u09fe\u09bc ক\u09fe\u09cd ষ\u09fe\u09bc\u09cd ষ\u09fe\u09cd\u09bc ক\u09fe",  # sandhi mark U+09FE (see normalizer())
    "▁ ▁▁x", " leading", "trailing ", "  ", "\n", "",
    f"{CHAT_SPECIALS[0]}user\nতুমি কেমন আছ?{CHAT_SPECIALS[1]}\n{CHAT_SPECIALS[0]}assistant\n",
]
# The alphabet of the random strings: the Bengali block, the characters normalize() touches, a few
# scripts NFC composes (Latin + combining acute, Hangul jamo), whitespace. Without U+09FE, which only
# HARD_CASES spell (tokenizers' NFC predates it: export.hf.hf_tokenizer.normalizer says what differs).
ALPHABET = ([chr(c) for c in range(0x0980, 0x0A00) if c != 0x09FE] + [NUKTA, ZWJ, ZWNJ, BOM, "\r", "\n", "\r\n", " ", "  ", "\t"]
            + list("aeiouAZ09.,!?") + ["\u0301", "\u0308", "\u1100", "\u1161", "\u11a8", "\u00e9", "\u2581"])


def shipped_raw() -> list[str]:
    """Every file of training/assets as it is on disk (not normalized): each whole file, each line,
    and each string inside each JSONL record (chat messages, questions, choices)."""
    out: list[str] = []
    for f in sorted(p for p in ASSETS.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()):
        text = f.read_text(encoding="utf-8")
        out += [text, *text.splitlines()]
        if f.suffix == ".jsonl":
            for line in text.splitlines():
                out += list(json_strings(json.loads(line))) if line.strip() else []
    return out


@pytest.fixture(scope="module")
def sp(bn_data) -> Tokenizer:
    return Tokenizer.load(bn_data / "tokenizer.model")


@pytest.fixture(scope="module")
def hf_tok(sp, tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("hf_tok")
    write_tokenizer(sp, d, MAX_LEN)
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert type(tok).__name__ in (FAST_CLASS, "TokenizersBackend")  # the file as written, not a rebuilt pipeline
    return tok


def _ours(sp: Tokenizer, text: str) -> list[int]:
    return sp.encode(text, bos=True, allow_special=True)  # transformers splits specials out of text too


def _mismatches(sp, hf_tok, texts: list[str]) -> list[str]:
    got = hf_tok(texts)["input_ids"]
    return [t for t, ids in zip(texts, got, strict=True) if ids != _ours(sp, t)]


def test_normalizer_is_training_normalize():
    """The tokenizer.json normalizer against normalize() itself, on shipped text and random strings
    over the characters where they could differ."""
    norm = normalizer()
    rng = random.Random(SEED)
    randoms = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, RANDOM_LEN))) for _ in range(RANDOM_STRINGS)]
    texts = shipped_raw() + HARD_CASES + randoms
    bad = [t for t in texts if norm.normalize_str(t) != normalize(t)]
    assert not bad, f"{len(bad)} of {len(texts)} differ, e.g. {[ascii(t) for t in bad[:3]]}"
    # the test exercises what it claims: un-normalized input, both nukta spellings, CR and BOM
    assert sum(t != normalize(t) for t in texts) > RANDOM_STRINGS // 2
    raw = ORTHOGRAPHY.read_text(encoding="utf-8")
    assert "\u09dc" in raw and "\u09a1\u09bc" in raw and not unicodedata.is_normalized("NFC", raw)


def test_ids_match_training_on_shipped_text(sp, hf_tok):
    texts = shipped_raw()
    assert len(texts) > MIN_SHIPPED and sum(t != normalize(t) for t in texts) > 0  # raw text, some not NFC
    bad = _mismatches(sp, hf_tok, texts)
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, e.g. {[t[:60] for t in bad[:2]]}"


def test_ids_match_training_on_hard_cases(sp, hf_tok):
    bad = _mismatches(sp, hf_tok, HARD_CASES)
    assert not bad, [ascii(t) for t in bad]
    # both spellings of each nukta letter give one token sequence
    for composed, pair in (("\u09dc", "\u09a1\u09bc"), ("\u09dd", "\u09a2\u09bc"), ("\u09df", "\u09af\u09bc")):
        assert hf_tok(f"বা{composed}ি")["input_ids"] == hf_tok(f"বা{pair}ি")["input_ids"]
    # byte fallback really happens (the emoji is no piece of a 2k vocabulary), and no <unk> anywhere
    ids = hf_tok("😀")["input_ids"]
    assert [hf_tok.convert_ids_to_tokens(i) for i in ids[1:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert all(sp.unk_id not in hf_tok(t)["input_ids"] for t in HARD_CASES)


def test_decode_round_trips(sp, hf_tok):
    texts = shipped_raw() + HARD_CASES
    for t in texts:
        ids = hf_tok(t, add_special_tokens=False)["input_ids"]
        plain = normalize(t)
        for s in CHAT_SPECIALS:
            plain = plain.replace(s, "")
        plain = plain.replace("\u2581", " ")  # a literal "▁" is SentencePiece's space: it decodes as one
        assert hf_tok.decode(ids, skip_special_tokens=True) == sp.decode(ids) == plain, ascii(t[:60])


def test_specials_and_chat_template(sp, hf_tok):
    assert [hf_tok.convert_tokens_to_ids(s) for s in (UNK, BOS, EOS, PAD, *CHAT_SPECIALS)] == [
        sp.unk_id, sp.bos_id, sp.eos_id, sp.pad_id, sp.im_start_id, sp.im_end_id]
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (sp.bos_id, sp.eos_id, sp.pad_id)
    msgs = [{"role": "system", "content": "তুমি সাহায্যকারী।"}, {"role": "user", "content": "বাড়ি\r\nকোথায়?"}]
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert normalize(text) == render(msgs)  # the template copies content as given; render() normalizes it
    ids = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(ids) == chat.encode(sp, msgs).ids  # training's own chat encoding


def test_ids_match_training_on_tatoeba(sp, hf_tok):
    """Opt-in breadth: the Tatoeba Bangla lines of ../shared/data, raw. The same on training/assets:
    test_ids_match_training_on_shipped_text."""
    lines = [x for x in Path(shared_path(*TATOEBA)).read_text(encoding="utf-8").splitlines() if x.strip()]
    bad = _mismatches(sp, hf_tok, lines)
    assert len(lines) > 1000 and not bad, f"{len(bad)} of {len(lines)} lines differ, e.g. {bad[:2]}"


def test_tokenizer_json_is_the_whole_pipeline(sp, tmp_path):
    """tokenizer.json alone (the `tokenizers` library, no transformers) gives the same ids."""
    from tokenizers import Tokenizer as HFTokenizer

    write_tokenizer(sp, tmp_path, MAX_LEN)
    t = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = HARD_CASES + shipped_raw()[:500]
    assert [e.ids for e in t.encode_batch(texts)] == [_ours(sp, x) for x in texts]
    assert build(sp).to_str() == t.to_str()

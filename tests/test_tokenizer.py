"""training.text.tokenizer: the same text always reaches the model as the same ids (CPU, offline).

A small tokenizer is trained on the Bangla + English text that ships in training/assets/corpus, exactly
as training.prepare trains it; Tatoeba lines (../shared/data) add opt-in breadth.
"""

from __future__ import annotations

import pytest
from conftest import CORPUS, ORTHOGRAPHY, TATOEBA, shared_path
from fixtures_tokenizer import shipped_lines, write_subset

from training.prepare import iter_file_docs, resolve_inputs
from training.text.normalization import NUKTA, ZWJ, ZWNJ, normalize
from training.text.tokenizer import BOS_ID, EOS_ID, IM_END, IM_START, UNK_ID, train_tokenizer

VOCAB = 2000
SUBSET_BYTES = 200_000
# Common words with ড় ঢ় য়, written with the precomposed letters U+09DC/09DD/09DF.
NUKTA_WORDS = ("ব\u09dc", "প\u09dcা", "আষা\u09dd", "যা\u09df", "ন\u09df", "হ\u09dfেছে", "গা\u09dd", "ছে\u09dcে", "আ\u09dfনা")
DECOMPOSE = str.maketrans({"\u09dc": "\u09a1" + NUKTA, "\u09dd": "\u09a2" + NUKTA, "\u09df": "\u09af" + NUKTA})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    corpus = write_subset(tmp_path_factory.mktemp("tokcorpus"), SUBSET_BYTES)
    lines = [ln for f in resolve_inputs([corpus]) for d in iter_file_docs(f) for ln in d.split("\n") if ln.strip()]
    return train_tokenizer(lines, VOCAB, num_threads=1)


def byte_pieces(tok, ids: list[int]) -> list[int]:
    return [i for i in ids if tok.sp.is_byte(i)]


def test_both_nukta_spellings_give_identical_ids(tok):
    for word in NUKTA_WORDS:
        decomposed = word.translate(DECOMPOSE)
        assert decomposed != word
        a, b = tok.encode(word), tok.encode(decomposed)
        assert a == b, word
        # The tokenizer learned the canonical spelling: words with the common ড় and য় need no byte
        # fallback (ঢ itself is too rare in 200 KB to pass character_coverage).
        if "\u09dd" not in word:
            assert not byte_pieces(tok, a), (word, [tok.id_to_piece(i) for i in a])


def _precomposed(line: str) -> str:
    """`line` with every base + nukta pair of ড় ঢ় য় written as the precomposed letter."""
    for pre, base in (("\u09dc", "\u09a1"), ("\u09dd", "\u09a2"), ("\u09df", "\u09af")):
        line = line.replace(base + NUKTA, pre)
    return line


@pytest.mark.parametrize("source", ["shipped", "tatoeba"])
def test_real_lines_in_either_spelling_give_identical_ids(tok, source):
    """On every clone the shipped text; opt-in breadth: Tatoeba's modern Bangla."""
    if source == "shipped":
        lines, least = [_precomposed(ln) for ln in shipped_lines()], 100
    else:
        lines, least = shared_path(*TATOEBA).read_text(encoding="utf-8").splitlines(), 500
    lines = [ln for ln in lines if any(c in ln for c in "\u09dc\u09dd\u09df")]
    assert len(lines) > least
    for ln in lines:
        assert tok.encode(ln) == tok.encode(ln.translate(DECOMPOSE))


def test_zwj_and_zwnj_are_preserved_not_folded(tok):
    for s in (f"র{ZWJ}্যাব এসেছে", f"ক্{ZWNJ}ষমা", f"জ্{ZWNJ}ঞান আর বিজ্ঞান"):
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert ids != tok.encode(s.replace(ZWJ, "").replace(ZWNJ, ""))


@pytest.mark.parametrize("source", ["shipped", "tatoeba"])
def test_real_zwj_and_zwnj_lines_roundtrip(tok, source):
    """On every clone the shipped orthography file; opt-in breadth: Tatoeba's modern Bangla."""
    text = (ORTHOGRAPHY if source == "shipped" else shared_path(*TATOEBA)).read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ZWJ in ln or ZWNJ in ln]
    assert lines, "the file holds ZWJ/ZWNJ lines"
    for ln in lines:
        assert tok.decode(tok.encode(ln)) == normalize(ln)


@pytest.mark.parametrize("source", ["shipped", "tatoeba"])
def test_decode_encode_roundtrip_every_line(tok, source):
    """On every clone each shipped line; opt-in breadth: all 5,120 Tatoeba lines."""
    if source == "shipped":
        lines = shipped_lines()
        assert len(lines) > 1000
    else:
        lines = shared_path(*TATOEBA).read_text(encoding="utf-8").splitlines()
        assert len(lines) == 5120
    bad = [ln for ln in lines if tok.decode(tok.encode(ln)) != normalize(ln)]
    assert not bad, bad[:3]
    assert all(UNK_ID not in tok.encode(ln) for ln in lines)


def test_unseen_characters_and_whitespace_roundtrip_by_byte_fallback(tok):
    for s in ("日本語 😀 Ω ∑", "  two  spaces\tand tab\nnew line ", "\n\n", " leading", "x" * 3000, "١٢٣ ৳৫০০"):
        ids = tok.encode(s)
        assert tok.decode(ids) == s and UNK_ID not in ids
    assert byte_pieces(tok, tok.encode("😀"))  # 4 UTF-8 bytes, no <unk>


def test_configuration_llama_cpp_reproduces(tok):
    spec = tok.trainer_spec()
    assert spec == {"model_type": "BPE", "byte_fallback": True, "add_dummy_prefix": False,
                    "remove_extra_whitespaces": False, "normalization_rule_name": "identity", "split_digits": True}
    for digits in ("2024", "২০২৪"):  # split digits: one token per digit (a piece or its byte sequence)
        pieces = [tok.id_to_piece(i) for i in tok.encode(digits)]
        assert len(pieces) == 4 or all(p.startswith("<0x") for p in pieces), pieces
        assert not any(len(p) > 1 and not p.startswith("<0x") for p in pieces), pieces
    assert [p.kind for p in tok.pieces()][:6] == ["unknown", "control", "control", "control", "control", "control"]
    assert sum(p.kind == "byte" for p in tok.pieces()) == 256


def test_specials_only_with_allow_special(tok):
    text = f"{IM_START}user\nনমস্কার{IM_END}"
    plain = tok.encode(text)
    assert tok.im_start_id not in plain and tok.im_end_id not in plain  # user text cannot inject them
    chat = tok.encode(text, allow_special=True, bos=True, eos=True)
    assert chat[0] == BOS_ID and chat[1] == tok.im_start_id and chat[-2] == tok.im_end_id and chat[-1] == EOS_ID
    assert tok.decode(chat, keep_special=True) == "<s>" + text + "</s>"
    assert tok.decode(plain) == text


def test_training_is_reproducible_and_thread_count_independent(tok, tmp_path):
    lines = [ln for f in sorted(CORPUS.glob("bn_*.txt")) for ln in f.read_text(encoding="utf-8").splitlines()
             if ln.strip()]
    a = train_tokenizer(lines, 800, num_threads=1)
    b = train_tokenizer(lines, 800, num_threads=2)
    assert a.proto == b.proto and a.sha256 == b.sha256

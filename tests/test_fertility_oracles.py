"""training/text/fertility.py on hand-built counts: the fertility and balance gates' arithmetic and verdicts,
from the requirement (docs/tokenizer.md): Bangla must reach 2.0 characters/token and 0.6 x English's
fertility; each language's token share / character share must lie in [0.8, 1.25]. The expected numbers
are the module docstring's worked cases (byte-level BPE: Bangla 1.4, English 3.9), computed by hand.
These are the fast tests the `fertility` mutation target runs (tests/test_prepare.py measures real
tokenizers, and let `ratio * en` -> `ratio / en` survive: nothing had Bangla above the floor and below
0.6 x English)."""

from __future__ import annotations

import pytest

import training.text.fertility as F

BN_DOC, EN_DOC = "আমার সোনার বাংলা", "the quick brown fox"


def counts(bn: tuple[int, int] | None = None, en: tuple[int, int] | None = None,
           other: tuple[int, int] | None = None) -> dict:
    """{lang: counts} from (chars, tokens) per language; bytes = 3 per Bangla character, 1 otherwise."""
    out = {}
    for lang, c, per_byte in (("bn", bn, 3), ("en", en, 1), ("other", other, 1)):
        if c is not None:
            out[lang] = {"n_docs": 1, "chars": c[0], "bytes": per_byte * c[0], "tokens": c[1]}
    return out


def gates(report: dict, **kw) -> tuple:
    fert, bal = F.fertility_gates(report, **kw)
    assert (fert.name, bal.name) == ("tokenizer.fertility", "tokenizer.balance")
    return fert, bal


def test_the_documented_limits() -> None:
    # docs/tokenizer.md: floor 2.0, ratio 0.6, balance [0.8, 1.25], languages under 2% of chars not gated
    assert (F.DEFAULT_FERTILITY_FLOOR, F.DEFAULT_FERTILITY_RATIO) == (2.0, 0.6)
    assert F.DEFAULT_BALANCE_RANGE == (0.8, 1.25)
    assert F.BALANCE_MIN_CHAR_SHARE == 0.02


def test_report_arithmetic_on_the_byte_level_trap() -> None:
    # 50/50 characters: Bangla 5460 chars in 3900 tokens (1.4), English 5460 in 1400 (3.9)
    r = F.report_from_counts(counts(bn=(5460, 3900), en=(5460, 1400)), vocab_size=256, tokenizer_sha256="s")
    bn, en = r["languages"]["bn"], r["languages"]["en"]
    assert (r["vocab_size"], r["tokenizer_sha256"], "other" in r["languages"]) == (256, "s", False)
    assert r["total"] == {"n_docs": 2, "chars": 10920, "bytes": 4 * 5460, "tokens": 5300,
                          "chars_per_token": 10920 / 5300, "bytes_per_token": 4 * 5460 / 5300}
    assert (bn["name"], bn["n_docs"], bn["chars"], bn["bytes"], bn["tokens"]) == ("Bangla", 1, 5460, 16380, 3900)
    assert bn["chars_per_token"] == pytest.approx(1.4) and en["chars_per_token"] == pytest.approx(3.9)
    assert bn["bytes_per_token"] == pytest.approx(4.2) and en["bytes_per_token"] == pytest.approx(3.9)
    assert bn["char_share"] == en["char_share"] == 0.5
    assert bn["token_share"] == pytest.approx(3900 / 5300) and en["token_share"] == pytest.approx(1400 / 5300)
    assert bn["balance"] == pytest.approx(1.4717, abs=1e-4) and en["balance"] == pytest.approx(0.5283, abs=1e-4)
    assert "target_char_share" not in r
    assert F.report_from_counts(counts(bn=(10, 5)), target_char_share={"bn": 1.0})["target_char_share"] == {"bn": 1.0}


def test_report_of_a_language_with_no_tokens_or_no_chars() -> None:
    r = F.report_from_counts(counts(bn=(10, 0), en=(0, 0)))
    assert list(r["languages"]) == ["bn"]  # no characters: not a language of the report
    bn = r["languages"]["bn"]
    assert (bn["chars_per_token"], bn["bytes_per_token"], bn["token_share"], bn["balance"]) == (None, None, 0.0, 0.0)
    assert (r["total"]["chars_per_token"], r["total"]["bytes_per_token"]) == (None, None)


def test_balance_ratios_of_the_docstring() -> None:
    got = F.balance_ratios({"bn": 1.4, "en": 3.9}, {"bn": 0.5, "en": 0.5})
    denom = 0.5 / 1.4 + 0.5 / 3.9
    assert got == pytest.approx({"bn": (1 / 1.4) / denom, "en": (1 / 3.9) / denom})
    assert got["bn"] == pytest.approx(1.47, abs=5e-3) and got["en"] == pytest.approx(0.53, abs=5e-3)


def test_the_trap_fails_both_fertility_rules_and_the_balance() -> None:
    fert, bal = gates(F.report_from_counts(counts(bn=(5460, 3900), en=(5460, 1400))))
    assert not fert.passed and fert.value == pytest.approx(1.4)
    assert fert.threshold == ">= 2 chars/token and >= 0.6 x English"
    assert fert.detail == ("Bangla 1.40 chars/token is below the floor 2; Bangla 1.40 chars/token is below "
                           "0.6 x English (0.6 x 3.90 = 2.34)")
    assert not bal.passed and bal.value == pytest.approx(0.5283, abs=1e-4)  # en: 0.8 / 0.53 is the furthest out
    assert bal.threshold == "token share / char share in [0.8, 1.25]"
    assert bal.detail == ("token share / char share outside [0.8, 1.25] for bn, en: bn 1.47 (73.6% of tokens / "
                          "50.0% of chars); en 0.53 (26.4% of tokens / 50.0% of chars)")


def test_above_the_floor_but_below_six_tenths_of_english_fails_on_the_ratio_alone() -> None:
    # Bangla 2.2 (floor met), English 3.9: 0.6 x 3.9 = 2.34 > 2.2 (`ratio / en` would ask for 0.15)
    fert, _ = gates(F.report_from_counts(counts(bn=(2200, 1000), en=(3900, 1000))))
    assert not fert.passed
    assert fert.detail == "Bangla 2.20 chars/token is below 0.6 x English (0.6 x 3.90 = 2.34)"


def test_each_fertility_limit_met_exactly_passes() -> None:
    # floor: exactly 2.0, no English; ratio: Bangla 3.0 = 0.6 x 5.0
    fert, _ = gates(F.report_from_counts(counts(bn=(2000, 1000))))
    assert fert.passed and fert.value == 2.0 and fert.detail == "Bangla 2.00 chars/token"
    assert fert.threshold == ">= 2 chars/token"  # no English: the ratio rule is not stated
    fert, _ = gates(F.report_from_counts(counts(bn=(3000, 1000), en=(5000, 1000))))
    assert fert.passed and fert.detail == "Bangla 3.00 chars/token, English 5.00"
    fert, _ = gates(F.report_from_counts(counts(bn=(2999, 1000), en=(5000, 1000))))
    assert not fert.passed and fert.detail == "Bangla 3.00 chars/token is below 0.6 x English (0.6 x 5.00 = 3.00)"
    fert, _ = gates(F.report_from_counts(counts(bn=(1999, 1000))))
    assert not fert.passed and fert.detail == "Bangla 2.00 chars/token is below the floor 2"


def test_the_callers_limits_replace_the_defaults() -> None:
    rep = F.report_from_counts(counts(bn=(2500, 1000), en=(3000, 1000)))
    fert, _ = gates(rep, floor=3.0, ratio=0.5)
    assert not fert.passed and fert.detail == "Bangla 2.50 chars/token is below the floor 3"
    assert fert.threshold == ">= 3 chars/token and >= 0.5 x English"
    fert, _ = gates(rep, ratio=0.9)
    assert fert.detail == "Bangla 2.50 chars/token is below 0.9 x English (0.9 x 3.00 = 2.70)"
    _, bal = gates(rep, balance_range=(0.95, 1.05))
    assert not bal.passed and bal.threshold == "token share / char share in [0.95, 1.05]"


def test_no_bangla_is_nothing_to_gate() -> None:
    fert, bal = gates(F.report_from_counts(counts(en=(3900, 1000))))
    assert fert.passed and fert.value is None and fert.detail == "no Bangla in the held-out documents: nothing to gate"
    assert fert.threshold == ">= 2 chars/token and >= 0.6 x English"
    assert bal.passed and bal.value == 1.0  # one language holds every token and every character


def test_balance_limits_met_exactly_pass_and_the_worst_is_reported() -> None:
    # 50/50 characters, token shares 5/9 and 4/9: balances 10/9 and 8/9, both inside; the worst is the one
    # nearest its limit relative to it: en (0.8 / 0.889 = 0.9) over bn (1.111 / 1.25 = 0.889)
    _, bal = gates(F.report_from_counts(counts(bn=(1000, 500), en=(1000, 400))))
    assert bal.passed and bal.value == pytest.approx(8 / 9)
    assert bal.detail == "bn 1.11 (55.6% of tokens / 50.0% of chars); en 0.89 (44.4% of tokens / 50.0% of chars)"
    rep = F.report_from_counts(counts(bn=(1000, 1000), en=(1000, 600)))  # balances exactly 1.25 and 0.75
    _, bal = gates(rep)
    assert not bal.passed and bal.detail.startswith("token share / char share outside [0.8, 1.25] for en: ")
    assert bal.value == 0.75
    _, bal = gates(rep, balance_range=(0.75, 1.25))  # both exactly at a limit: both pass (inclusive)
    assert bal.passed and bal.value == 1.25  # a tie: the first language keeps it


def test_a_language_under_two_percent_of_the_characters_is_reported_not_gated() -> None:
    # other/mixed: 1% of characters at a wild balance; Bangla and English balanced
    rep = F.report_from_counts(counts(bn=(4950, 1650), en=(4950, 1650), other=(100, 300)))
    _, bal = gates(rep)
    assert rep["languages"]["other"]["char_share"] == 0.01
    # tokens: 1650 + 1650 + 300 = 3600, so bn and en hold 45.8% of them on 49.5% of the chars: 0.93
    assert bal.passed and bal.detail == ("bn 0.93 (45.8% of tokens / 49.5% of chars); en 0.93 (45.8% of tokens / "
                                         "49.5% of chars); not gated (< 2% of chars): other")
    _, bal = gates(rep, min_char_share=0.01)  # at the share exactly: gated, and out of range
    assert not bal.passed and "for other:" in bal.detail


class Tok:
    """A tokenizer stand-in: Bangla one token per 2 characters, everything else one per 4."""

    vocab_size, sha256 = 300, "tok"

    def __init__(self) -> None:
        self.batches: list[int] = []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.batches.append(len(texts))
        return [[0] * (len(t) // (2 if t[0] > "\u0900" else 4)) for t in texts]


def test_fertility_report_counts_normalized_documents_per_language_in_batches() -> None:
    tok = Tok()
    docs = [BN_DOC] * 300 + ["   ", ""] + [EN_DOC] * 10
    r = F.fertility_report(tok, docs, target_char_share={"bn": 0.9})
    assert tok.batches == [256, 54]  # ENCODE_BATCH_DOCS at a time, blank documents left out
    bn, en = r["languages"]["bn"], r["languages"]["en"]
    assert (bn["n_docs"], bn["chars"], bn["tokens"]) == (300, 300 * len(BN_DOC), 300 * (len(BN_DOC) // 2))
    assert bn["bytes"] == 300 * len(BN_DOC.encode("utf-8"))
    assert (en["n_docs"], en["chars"], en["tokens"]) == (10, 10 * len(EN_DOC), 10 * (len(EN_DOC) // 4))
    assert (r["vocab_size"], r["tokenizer_sha256"], r["target_char_share"]) == (300, "tok", {"bn": 0.9})


def test_format_table_rows() -> None:
    r = F.report_from_counts(counts(bn=(5460, 3900), en=(5460, 1400)), target_char_share={"bn": 0.5})
    lines = F.format_table(r).splitlines()
    assert lines[0] == ("| language | docs | chars | tokens | chars/token | bytes/token | char share | token share "
                        "| token/char share | target char share |")
    assert lines[2] == "| Bangla (bn) | 1 | 5,460 | 3,900 | 1.40 | 4.20 | 50.0% | 73.6% | 1.47 | 50.0% |"
    assert lines[3] == "| English (en) | 1 | 5,460 | 1,400 | 3.90 | 3.90 | 50.0% | 26.4% | 0.53 |  |"
    assert lines[4] == "| all | 2 | 10,920 | 5,300 | 2.06 | 4.12 | 100% | 100% | 1.00 | |"
    assert F.format_table(F.report_from_counts(counts(bn=(10, 0)))).splitlines()[2].split(" | ")[4] == "n/a"


def test_two_languages_not_gated_are_both_named() -> None:
    rep = F.report_from_counts(counts(bn=(9800, 3000), en=(100, 30), other=(100, 30)))
    _, bal = gates(rep)
    assert bal.detail.endswith("; not gated (< 2% of chars): en, other")


def test_counts_without_a_document_count_are_zero_documents() -> None:
    # n_docs is optional in a count (report_from_counts' docstring lists it; a caller may have only chars)
    r = F.report_from_counts({"bn": {"chars": 10, "bytes": 30, "tokens": 5}, "en": {"chars": 10, "bytes": 10,
                                                                                  "tokens": 2, "n_docs": 3}})
    assert r["total"]["n_docs"] == 3 and r["languages"]["bn"]["n_docs"] == 0
    assert F.format_table(r).splitlines()[1] == "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"

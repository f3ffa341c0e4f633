"""Fertility and language-balance report for a tokenizer, and the two gates that guard it.

Fertility is characters per token (of `training.text.normalization.normalize`d text, without <s>/</s>), measured
per language on held-out documents. Each document gets one language from
`training.text.normalization.detect_language` (Bangla, English, or other/mixed).

Balance: with fertility f_l and character share c_l, language l's share of the *tokens* is
    t_l = (c_l / f_l) / sum_k(c_k / f_k),   so   t_l / c_l = (1 / f_l) / sum_k(c_k / f_k).
A language the tokenizer serves badly (low f_l) takes more of the token budget, and so more of the
training steps, than its share of the text. The ratio t_l / c_l is what the balance gate bounds.

The reference failure (byte-level BPE: Bangla 1.4 characters/token, English 3.9), for a 50/50 mix:
    fertility gate: 1.4 < 2.0 (floor) and 1.4 < 0.6 x 3.9 = 2.34            -> FAIL (both rules)
    sum_k c_k/f_k = 0.5/1.4 + 0.5/3.9 = 0.357 + 0.128 = 0.485
    balance: bn (1/1.4)/0.485 = 1.47 > 1.25, en (1/3.9)/0.485 = 0.53 < 0.8   -> FAIL
and for an 80/20 Bangla-heavy mix: sum = 0.571 + 0.051 = 0.623, bn 1.15, en 0.41 < 0.8 -> FAIL.
Healthy tokenizers (BPE + byte fallback, calibration in docs/tokenizer.md) sit near 1: e.g. 8k
vocabulary, 3.0 / 3.7 at 50/50: sum = 0.167 + 0.135 = 0.302, bn 1.10, en 0.89 -> pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from training.runfiles.gate_results import GateResult
from training.text.normalization import LANGUAGES, detect_language, normalize
from training.text.tokenizer import Tokenizer

FERTILITY_GATE = "tokenizer.fertility"
BALANCE_GATE = "tokenizer.balance"
GATE_NAMES = (FERTILITY_GATE, BALANCE_GATE)

DEFAULT_FERTILITY_FLOOR = 2.0  # Bangla characters/token, absolute
DEFAULT_FERTILITY_RATIO = 0.6  # Bangla fertility must reach this fraction of English's
DEFAULT_BALANCE_RANGE = (0.8, 1.25)  # token share / character share, per language
# Languages holding less than this share of the held-out characters are reported but not gated:
# a handful of mixed-script lines (headings, numbers) would otherwise decide the gate by noise.
BALANCE_MIN_CHAR_SHARE = 0.02
LANGUAGE_NAMES = {"bn": "Bangla", "en": "English", "other": "other/mixed"}
ENCODE_BATCH_DOCS = 256


def report_from_counts(counts: Mapping[str, Mapping[str, int]], *, vocab_size: int | None = None,
                       tokenizer_sha256: str | None = None,
                       target_char_share: Mapping[str, float] | None = None) -> dict:
    """Derive fertility, shares and balance from raw per-language counts.

    counts: {lang: {"n_docs", "chars", "bytes", "tokens"}}. Kept separate from the measuring so the
    gates can be checked on constructed cases (the 1.4-vs-3.9 trap) with the same arithmetic.
    """
    total = {k: sum(int(c.get(k, 0)) for c in counts.values()) for k in ("n_docs", "chars", "bytes", "tokens")}
    langs: dict[str, dict] = {}
    for lang in LANGUAGES:
        c = counts.get(lang)
        if not c or not c.get("chars"):
            continue
        chars, nbytes, tokens = int(c["chars"]), int(c["bytes"]), int(c["tokens"])
        char_share = chars / total["chars"] if total["chars"] else 0.0
        token_share = tokens / total["tokens"] if total["tokens"] else 0.0
        langs[lang] = {
            "name": LANGUAGE_NAMES[lang],
            "n_docs": int(c.get("n_docs", 0)),
            "chars": chars,
            "bytes": nbytes,
            "tokens": tokens,
            "chars_per_token": chars / tokens if tokens else None,
            "bytes_per_token": nbytes / tokens if tokens else None,
            "char_share": char_share,
            "token_share": token_share,
            "balance": token_share / char_share if char_share else None,
        }
    report = {
        "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_sha256,
        "total": {**total,
                  "chars_per_token": total["chars"] / total["tokens"] if total["tokens"] else None,
                  "bytes_per_token": total["bytes"] / total["tokens"] if total["tokens"] else None},
        "languages": langs,
    }
    if target_char_share:
        report["target_char_share"] = dict(target_char_share)
    return report


def fertility_report(tokenizer: Tokenizer, docs: Iterable[str], *,
                     target_char_share: Mapping[str, float] | None = None) -> dict:
    """Measure characters/token, bytes/token and token vs character share per language over `docs`."""
    counts = {lang: {"n_docs": 0, "chars": 0, "bytes": 0, "tokens": 0} for lang in LANGUAGES}
    batch: list[str] = []

    def flush() -> None:
        for doc, ids in zip(batch, tokenizer.encode_batch(batch)):
            c = counts[detect_language(doc)]
            c["n_docs"] += 1
            c["chars"] += len(doc)
            c["bytes"] += len(doc.encode("utf-8"))
            c["tokens"] += len(ids)
        batch.clear()

    for doc in docs:
        doc = normalize(doc)
        if doc.strip():
            batch.append(doc)
            if len(batch) >= ENCODE_BATCH_DOCS:
                flush()
    flush()
    return report_from_counts(counts, vocab_size=tokenizer.vocab_size, tokenizer_sha256=tokenizer.sha256,
                              target_char_share=target_char_share)


def balance_ratios(fertility: Mapping[str, float], char_share: Mapping[str, float]) -> dict[str, float]:
    """t_l / c_l = (1/f_l) / sum_k(c_k/f_k): the balance arithmetic without measuring anything."""
    denom = sum(char_share[k] / fertility[k] for k in fertility)
    return {lang: (1.0 / f) / denom for lang, f in fertility.items()}


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def fertility_gates(report: Mapping, *, floor: float = DEFAULT_FERTILITY_FLOOR, ratio: float = DEFAULT_FERTILITY_RATIO,
                    balance_range: tuple[float, float] = DEFAULT_BALANCE_RANGE,
                    min_char_share: float = BALANCE_MIN_CHAR_SHARE) -> list[GateResult]:
    """The fertility gate (Bangla floor and ratio to English) and the balance gate, from a report."""
    langs = report["languages"]
    bn, en = langs.get("bn"), langs.get("en")
    threshold = f">= {floor:g} chars/token" + (f" and >= {ratio:g} x English" if en else "")
    if not bn or bn["chars_per_token"] is None:
        fert = GateResult(FERTILITY_GATE, True, None, threshold, "no Bangla in the held-out documents: nothing to gate")
    else:
        f_bn = bn["chars_per_token"]
        problems = []
        if f_bn < floor:
            problems.append(f"Bangla {f_bn:.2f} chars/token is below the floor {floor:g}")
        if en and en["chars_per_token"]:
            need = ratio * en["chars_per_token"]
            if f_bn < need:
                problems.append(f"Bangla {f_bn:.2f} chars/token is below {ratio:g} x English "
                                f"({ratio:g} x {en['chars_per_token']:.2f} = {need:.2f})")
        detail = "; ".join(problems) if problems else (
            f"Bangla {f_bn:.2f} chars/token" + (f", English {en['chars_per_token']:.2f}" if en else ""))
        fert = GateResult(FERTILITY_GATE, not problems, f_bn, threshold, detail)

    lo, hi = balance_range
    gated = {k: v for k, v in langs.items() if v["balance"] is not None and v["char_share"] >= min_char_share}
    parts, bad, worst, worst_dev = [], [], None, -1.0
    for lang, v in gated.items():
        b = v["balance"]
        parts.append(f"{lang} {b:.2f} ({v['token_share']:.1%} of tokens / {v['char_share']:.1%} of chars)")
        if not lo <= b <= hi:
            bad.append(lang)
        dev = max(b / hi, lo / b)  # > 1 when outside the range; the largest is the worst
        if dev > worst_dev:
            worst, worst_dev = b, dev
    not_gated = sorted(set(langs) - set(gated))
    detail = "; ".join(parts)
    if not_gated:
        detail += f"; not gated (< {min_char_share:.0%} of chars): {', '.join(not_gated)}"
    if bad:
        detail = f"token share / char share outside [{lo:g}, {hi:g}] for {', '.join(bad)}: " + detail
    bal = GateResult(BALANCE_GATE, not bad, worst, f"token share / char share in [{lo:g}, {hi:g}]", detail)
    return [fert, bal]


def format_table(report: Mapping) -> str:
    """The fertility table as Markdown (printed by the CLI, written to report.md)."""
    target = report.get("target_char_share") or {}
    rows = ["| language | docs | chars | tokens | chars/token | bytes/token | char share | token share "
            "| token/char share | target char share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lang, v in report["languages"].items():
        t = f"{target[lang]:.1%}" if lang in target else ""
        rows.append(f"| {v['name']} ({lang}) | {v['n_docs']:,} | {v['chars']:,} | {v['tokens']:,} | "
                    f"{_fmt(v['chars_per_token'])} | {_fmt(v['bytes_per_token'])} | {v['char_share']:.1%} | "
                    f"{v['token_share']:.1%} | {_fmt(v['balance'])} | {t} |")
    tot = report["total"]
    rows.append(f"| all | {tot['n_docs']:,} | {tot['chars']:,} | {tot['tokens']:,} | {_fmt(tot['chars_per_token'])} | "
                f"{_fmt(tot['bytes_per_token'])} | 100% | 100% | 1.00 | |")
    return "\n".join(rows)


def plot_report(report: Mapping, path: Path, *, floor: float | None = DEFAULT_FERTILITY_FLOOR) -> None:
    """Bar chart: chars/token per language, and token share vs character share (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    langs = list(report["languages"].items())
    names = [f"{v['name']}" for _, v in langs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, [v["chars_per_token"] or 0 for _, v in langs], color="#4c72b0")
    if floor is not None:
        ax1.axhline(floor, color="red", linestyle="--", label=f"Bangla floor {floor:g}")
        ax1.legend()
    ax1.set_ylabel("characters / token")
    ax1.set_title(f"Fertility (held-out, vocab {report.get('vocab_size')})")
    xs = range(len(langs))
    width = 0.4
    ax2.bar([x - width / 2 for x in xs], [100 * v["char_share"] for _, v in langs], width, label="characters")
    ax2.bar([x + width / 2 for x in xs], [100 * v["token_share"] for _, v in langs], width, label="tokens")
    target = report.get("target_char_share") or {}
    for x, (lang, _) in zip(xs, langs):
        if lang in target:
            ax2.plot([x - width, x], [100 * target[lang]] * 2, color="black", linestyle="--")
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("share (%)")
    ax2.set_title("Balance: token share vs character share")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""report.json and report.md of a data folder: fertility and gates (as before), and what the clean
pass removed and why: quality rules with examples, duplicates, decontamination."""

from __future__ import annotations

from training.gates import GateReport
from training.prepare.clean import CleanResult
from training.prepare.decontam import EvalIndex
from training.prepare.dedup import MAX_LOAD, index_bytes_per_doc
from training.prepare.options import Options
from training.prepare.quality import PrepConfig
from training.text.fertility import format_table

DUPLICATES = ("exact_duplicate", "near_duplicate")


def cleaning_sections(cr: CleanResult, opt: Options, cfg: PrepConfig, eval_index: EvalIndex | None) -> dict:
    """The quality, dedup and decontamination sections of report.json."""
    kept = sum(s["n_docs"] for s in cr.kept.values())
    rule_names = {k: v for k, v in cr.dropped.items() if k not in DUPLICATES and k != "contaminated"}
    bands = cfg.dedup["bands"]
    keys_per_doc = 1 + (bands if opt.near_dedup else 0)
    return {
        "documents": {"raw": cr.n_raw - cr.n_other_shards, "kept": kept, "dropped": sum(cr.dropped.values()),
                      "dropped_by_reason": dict(sorted(cr.dropped.items())),
                      "dropped_chars_by_reason": dict(sorted(cr.dropped_chars.items()))},
        "quality": {"enabled": opt.filters, "config": cfg.path, "rules": cfg.quality.to_dict(),
                    "dropped": rule_names,
                    "examples": {k: v for k, v in cr.examples.items() if k in rule_names}},
        "dedup": {"enabled": opt.dedup, "near": opt.dedup and opt.near_dedup, "method": "exact: blake2b-64 of the "
                  "whitespace-collapsed normalized document; near: datasketch MinHash over word shingles, LSH bands",
                  **cfg.dedup, "rows_per_band": cfg.dedup["num_perm"] // bands,
                  "threshold_50pct": (1 / bands) ** (bands / cfg.dedup["num_perm"]),
                  "exact_duplicates": cr.dropped.get("exact_duplicate", 0),
                  "near_duplicates": cr.dropped.get("near_duplicate", 0),
                  "examples": {k: v for k, v in cr.examples.items() if k in DUPLICATES},
                  "index_bytes_per_million_docs": [int(index_bytes_per_doc(keys_per_doc) * 1e6),
                                                   int(index_bytes_per_doc(keys_per_doc, MAX_LOAD / 2) * 1e6)],
                  **cr.dedup},
        "decontamination": {"enabled": eval_index is not None,
                            "ngram_words": cfg.decontam["ngram_words"], "min_words": cfg.decontam["min_words"],
                            "sets": eval_index.sets if eval_index is not None else [],
                            "documents_removed": cr.dropped.get("contaminated", 0),
                            "removed": cr.contaminated},
    }


def _examples(lines: list[str], examples: dict[str, list[str]]) -> None:
    for reason, snippets in sorted(examples.items()):
        for s in snippets:
            one = " ".join(s.split())[:160]
            lines.append(f"- `{reason}`: {one}")


def cleaning_md(sections: dict) -> list[str]:
    d, q, dd, dc = sections["documents"], sections["quality"], sections["dedup"], sections["decontamination"]
    lines = ["## What was removed, and why", "",
             f"{d['raw']:,} documents read, {d['kept']:,} kept, {d['dropped']:,} removed.", "",
             "| reason | documents | characters |", "|---|---:|---:|"]
    for reason, n in d["dropped_by_reason"].items():
        lines.append(f"| {reason} | {n:,} | {d['dropped_chars_by_reason'].get(reason, 0):,} |")
    lines += ["", f"Quality rules from `{q['config']}`" + ("" if q["enabled"] else " (turned off)") + ".",
              f"Deduplication: exact {dd['exact_duplicates']:,}, near {dd['near_duplicates']:,} (MinHash "
              f"{dd['num_perm']} permutations, {dd['bands']} bands x {dd['rows_per_band']} rows, word "
              f"{dd['shingle_words']}-grams, 50 % detection at Jaccard {dd['threshold_50pct']:.2f}; index "
              f"{dd.get('index_bytes', 0) / 2**20:.1f} MiB).", ""]
    if dd.get("index_full_warning"):
        lines += [f"**Deduplication incomplete:** {dd['index_full_warning']}.", ""]
    lines += ["Removed examples:", ""]
    _examples(lines, {**q["examples"], **dd["examples"]})
    lines += ["", "## Decontamination", "",
              f"Word {dc['ngram_words']}-gram overlap with each eval set (texts of {dc['min_words']}-"
              f"{dc['ngram_words'] - 1} words must match whole).", "",
              "| eval set | sha256 | texts | n-grams | documents removed |", "|---|---|---|---:|---:|"]
    for s in dc["sets"]:
        lines.append(f"| `{s['path']}` | `{s['sha256'][:12]}` | {s['texts']} | {s['ngrams']:,} | {s['documents_removed']:,} |")
    for r in dc["removed"][:5]:
        lines.append(f"- removed (matches `{r['eval_set']}`): {' '.join(r['snippet'].split())[:160]}")
    return lines + [""]


def report_md(report: dict, greport: GateReport, stats: dict, sections: dict | None) -> str:
    lines = ["# Tokenizer fertility and balance (held-out split)", "",
             f"Vocabulary {report['vocab_size']}, tokenizer sha256 `{report['tokenizer_sha256'][:16]}`, "
             f"{report['held_out_docs']:,} held-out documents.", "", format_table(report), "",
             "## Gates", "", greport.table(), "", greport.summary(), "", "## Splits", "",
             "| split | documents | characters | bytes | tokens | shards |", "|---|---:|---:|---:|---:|---:|"]
    for split, st in stats.items():
        lines.append(f"| {split} | {st['n_docs']:,} | {st['n_chars']:,} | {st['n_bytes']:,} | {st['n_tokens']:,} | "
                     f"{st['n_shards']} |")
    lines.append("")
    if sections is not None:
        lines += cleaning_md(sections)
    lines += ["![fertility](fertility.png)", ""]
    return "\n".join(lines)

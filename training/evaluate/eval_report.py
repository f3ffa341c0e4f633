"""The evaluation report: eval.json (every number; other code reads it, so its shape is a format),
eval.md (the tables), eval.png (bits per byte by language; accuracy with 95% CI and chance), and a
section of the model card between `<!-- prodip:MARKER:begin -->` and `<!-- prodip:MARKER:end -->`."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from training.evaluate.providers import EvalError
from training.evaluate.request import EvalRequest
from training.runfiles import layout
from training.runfiles.gate_results import GateResult

EVAL_FORMAT = 1  # "prodip_eval" in eval.json
CARD_MARKER = "eval"
OUTPUT_FILES = layout.EVAL_FILES  # eval.json, eval.md, eval.png


def add_deltas(models: list[dict], reference: str) -> None:
    """Bits-per-byte and accuracy deltas of every model against the `reference` model (in place)."""
    ref = next((m for m in models if m["name"] == reference), None)
    if ref is None:
        return
    for m in models:
        if m is ref:
            continue
        m["delta_vs"] = reference
        m["delta"] = {
            "bits_per_byte": {lang: st["bits_per_byte"] - ref["lm"][lang]["bits_per_byte"]
                              for lang, st in m["lm"].items() if lang in ref["lm"]},
            "acc": {k: s["acc"]["value"] - ref["mc"][k]["acc"]["value"] for k, s in m["mc"].items() if k in ref["mc"]},
            "acc_norm_byte": {k: s["acc_norm_byte"]["value"] - ref["mc"][k]["acc_norm_byte"]["value"]
                              for k, s in m["mc"].items() if k in ref["mc"]},
        }


def make_report(kind: str, source: str, models: list[dict], req: EvalRequest, *, gates: Sequence[GateResult] = (),
                reference: str | None = None, extra: dict | None = None) -> dict:
    if reference:
        add_deltas(models, reference)
    return {
        "prodip_eval": EVAL_FORMAT, "kind": kind, "source": source,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "texts": req.text_files, "mc_files": {name: {"path": p, "format": f} for name, p, f, _ in req.mc_sets},
        "reference": reference, "models": models, "gates": [g.to_dict() for g in gates], **(extra or {}),
    }


def _f(x: float | None, nd: int = 3) -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _signed(x: float | None, nd: int = 3) -> str:
    return "" if x is None or not math.isfinite(x) else f"{x:+.{nd}f}"


def _lm_table(models: list[dict], heading: str) -> list[str]:
    lines = [f"{heading}# Language modelling", "",
             "Bits per byte and per character are tokenizer-independent (UTF-8 bytes / characters of the "
             "normalized text); NLL per token and perplexity depend on the tokenizer.", "",
             "| language | model | docs | tokens | bytes | NLL/token | bits/byte | bits/char | perplexity | Δ bits/byte |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lang in dict.fromkeys(lang for m in models for lang in m["lm"]):
        for m in models:
            st = m["lm"].get(lang)
            if not st:
                continue
            d = m.get("delta", {}).get("bits_per_byte", {}).get(lang)
            lines.append(f"| {lang} | {m['name']} | {st['docs']} | {st['tokens']} | {st['bytes']} | "
                         f"{_f(st['nll_per_token'])} | {_f(st['bits_per_byte'])} | {_f(st['bits_per_char'])} | "
                         f"{_f(st['perplexity'], 1)} | {_signed(d, 4)} |")
    return [*lines, ""]


def _mc_table(models: list[dict], heading: str) -> list[str]:
    lines = [f"{heading}# Multiple choice", "",
             "Accuracy with a 95% Wilson interval; acc ranks choices by summed log-likelihood, acc_norm by "
             "log-likelihood per character / per byte of the choice.", "",
             "| set | model | n | ways | chance | acc [95% CI] | acc_norm (char) | acc_norm (byte) | Δ acc |",
             "|---|---|---:|---|---:|---|---:|---:|---:|"]
    for k in dict.fromkeys(k for m in models for k in m["mc"]):
        for m in models:
            s = m["mc"].get(k)
            if not s:
                continue
            ways = ", ".join(f"{w}-way×{c}" if len(s["ways"]) > 1 else f"{w}-way" for w, c in s["ways"].items())
            a = s["acc"]
            d = m.get("delta", {}).get("acc", {}).get(k)
            lines.append(f"| {k} | {m['name']} | {s['n']} | {ways} | {_f(s['chance'])} | "
                         f"{_f(a['value'])} [{_f(a['ci95'][0])}, {_f(a['ci95'][1])}] | "
                         f"{_f(s['acc_norm_char']['value'])} | {_f(s['acc_norm_byte']['value'])} | {_signed(d)} |")
    return [*lines, ""]


def _wellformed_table(models: list[dict], heading: str) -> list[str]:
    lines = [f"{heading}# Well-formedness of generated text", "",
             "Greedy answers to fixed prompts; share of their Bengali grapheme clusters that are valid "
             "orthography (no vowel sign or virama without a base consonant, no two vowel signs in a row).", "",
             "| model | prompts | format | tokens/answer | clusters | well-formed | invalid clusters (examples) |",
             "|---|---:|---|---:|---:|---:|---|"]
    for m in models:
        w = m.get("wellformed")
        if w:
            bad = ", ".join(f"`{c}`" for c in w["examples"])
            share = f"{100 * w['share']:.1f}%" if w["clusters"] else "— (no Bangla written)"
            lines.append(f"| {m['name']} | {w['prompts']} | {'chat' if w['chat'] else 'plain'} | "
                         f"{w['max_new_tokens']} | {w['clusters']} | {share} | {bad} |")
    first = next(m for m in models if m.get("wellformed"))
    lines += ["", f"Answers of `{first['name']}`:", ""]
    lines += [f"- {s['prompt']} → {' '.join(s['text'].split()) or '(empty)'}" for s in first["wellformed"]["samples"]]
    return [*lines, ""]


def _base_table(comp: dict, heading: str) -> list[str]:
    """eval.json's "init_from" (training.evaluate.against_base): bits/byte of the base, the extended-untrained and the
    continued model side by side."""
    names = list(dict.fromkeys(n for row in comp["bits_per_byte"].values() for n in row))
    vocab = (f"its {comp['base_vocab']:,} pieces extended to {comp['vocab']:,}" if comp["extended"]
             else f"the same {comp['vocab']:,}-piece tokenizer")
    lines = [f"{heading}# Against the base", "",
             f"The run started from `{comp['folder']}` ({vocab}). Bits per byte of the same normalized text "
             "(lower is better); the base is scored with its own tokenizer.", "",
             "| language | " + " | ".join(names) + " | Δ model − base |", "|---|" + "---:|" * (len(names) + 1)]
    for lang, row in comp["bits_per_byte"].items():
        d = row["model"] - row["base"] if "model" in row and "base" in row else None
        lines.append(f"| {lang} | " + " | ".join(_f(row.get(n)) for n in names) + f" | {_signed(d, 4)} |")
    return [*lines, ""]


def render_markdown(report: dict, *, heading: str = "##") -> str:
    step = f" (step {report['step']})" if report.get("step") is not None else ""
    lines = [f"{heading} Evaluation", "", f"Source: `{report['source']}`{step}", ""]
    models = report["models"]
    if any(m["lm"] for m in models):
        lines += _lm_table(models, heading)
    if report.get("init_from"):
        lines += _base_table(report["init_from"], heading)
    if any(m["mc"] for m in models):
        lines += _mc_table(models, heading)
    if any(m.get("wellformed") for m in models):
        lines += _wellformed_table(models, heading)
    if report.get("decontamination"):
        lines += [f"{heading}# Decontamination", "", "| eval file | against the run's training data |", "|---|---|"]
        lines += [f"| `{p}` | {status} |" for p, status in report["decontamination"].items()]
        lines.append("")
    if report.get("gates"):
        lines += [f"{heading}# Gates", "", "| gate | result | value | threshold | detail |", "|---|---|---|---|---|"]
        for g in report["gates"]:
            lines.append(f"| {g['name']} | {'pass' if g['passed'] else 'FAIL'} | {g['value']} | {g['threshold']} | {g['detail']} |")
        lines.append("")
    return "\n".join(lines)


def _bars(ax, panel: str, groups: list[str], shown: list[dict], width: float) -> None:
    x = np.arange(len(groups))
    for i, m in enumerate(shown):
        if panel == "lm":
            ax.bar(x + i * width, [m["lm"].get(g, {}).get("bits_per_byte", np.nan) for g in groups], width,
                   label=m["name"])
            continue
        s = [m["mc"].get(g) for g in groups]
        vals = [v["acc"]["value"] if v else np.nan for v in s]
        err = np.array([[v["acc"]["value"] - v["acc"]["ci95"][0], v["acc"]["ci95"][1] - v["acc"]["value"]]
                        if v else [0, 0] for v in s]).T
        ax.bar(x + i * width, vals, width, yerr=err, capsize=3, label=m["name"])
    if panel == "mc":
        chance = [next((m["mc"][g]["chance"] for m in shown if g in m["mc"]), np.nan) for g in groups]
        ax.hlines(chance, x - width / 2, x + width * (len(shown) - 0.5), colors="k", linestyles="dashed",
                  label="chance")
        ax.set_ylabel("accuracy (95% Wilson CI)")
        ax.set_ylim(0, 1)
        ax.set_title("multiple choice")
    else:
        ax.set_ylabel("bits per byte (lower is better)")
        ax.set_title("language modelling")
    ax.set_xticks(x + width * (len(shown) - 1) / 2, groups, rotation=30, ha="right")
    ax.legend(fontsize="small")


def render_chart(report: dict, path: Path) -> None:
    """Bits per byte per language and MC accuracy (95% CI, chance marked), one bar per model."""
    import matplotlib  # lazy: matplotlib costs a second to import and only this writes a chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    langs = list(dict.fromkeys(lang for m in models for lang in m["lm"]))
    sets = list(dict.fromkeys(k for m in models for k in m["mc"]))
    panels = [(p, groups) for p, groups in (("lm", langs), ("mc", sets)) if groups]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.2), squeeze=False)
    for ax, (panel, groups) in zip(axes[0], panels):
        shown = [m for m in models if m[panel]]  # e.g. the twin has no multiple-choice scores
        _bars(ax, panel, groups, shown, 0.8 / len(shown))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: dict, out_dir: Path, *, force: bool = False) -> list[Path]:
    out_dir = Path(out_dir)
    paths = [out_dir / f for f in OUTPUT_FILES]
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise EvalError(f"{existing[0]} already exists; pass --force to overwrite or --out DIR")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps(report, indent=2, ensure_ascii=False, allow_nan=True) + "\n", encoding="utf-8")
    paths[1].write_text(render_markdown(report, heading="#") + "\n", encoding="utf-8")
    render_chart(report, paths[2])
    return paths


def update_card(card: Path, section: str, *, marker: str = CARD_MARKER, force: bool = False) -> bool:
    """Append `section` to the model card between markers; replace a previous one only with force."""
    begin, end = f"<!-- prodip:{marker}:begin -->", f"<!-- prodip:{marker}:end -->"
    text = card.read_text(encoding="utf-8")
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in text and end in text:
        if not force:
            raise EvalError(f"{card} already has an evaluation section; pass --force to replace it")
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    card.write_text(text, encoding="utf-8")
    return True

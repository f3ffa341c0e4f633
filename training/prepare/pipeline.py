"""prepare(): inputs -> DATA_DIR (tokenizer, shards, meta.json, report.json/md), behind the gates.

    check files -> clean (quality, decontamination, dedup; parallel) -> [sample sentences, train the
    tokenizer] -> fertility report + gates -> encode (parallel) -> rename into place

Everything is written into a temporary folder beside DATA_DIR and renamed at the end: a failed
gate, an error or a crash leaves no half-written DATA_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from training.gates import GateReport
from training.prepare.clean import CleanResult, clean_pass, validate_files
from training.prepare.cluster.worker_memory import plan_memory
from training.prepare.decontam import EvalIndex, resolve_eval_paths
from training.prepare.encode import encode_pass
from training.prepare.errors import GateFailed, PrepareError
from training.prepare.options import (
    DATA_FORMAT_VERSION,
    DEFAULT_VOCAB_SIZE,
    Options,
    mix_keep_probabilities,
    parse_mix,
)
from training.prepare.prepare_report import cleaning_sections, report_md
from training.prepare.quality import load_config
from training.prepare.sample import mix_kept, sample_sentences
from training.prepare.sources import resolve_sources
from training.runfiles import layout
from training.text import vocab_extend
from training.text.fertility import fertility_gates, fertility_report, format_table, plot_report
from training.text.tokenizer import Tokenizer, TokenizerError, train_tokenizer

FERTILITY_PNG = "fertility.png"


def _options(options: dict) -> Options:
    try:
        opt = Options(**options)
    except TypeError as e:
        raise PrepareError(f"prepare(): {e}") from None
    opt.mix = parse_mix(opt.mix)
    opt.balance_range = tuple(opt.balance_range)  # type: ignore[assignment]
    opt.skip_gates = list(opt.skip_gates or [])
    opt.decontaminate = [Path(p) for p in opt.decontaminate or []]
    opt.validate()
    return opt


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise PrepareError(f"{out} already exists; pass --force to replace it")



def write_report(tmp: Path, opt: Options, report: dict, greport, stats: dict, sections: dict, memory: dict,
                 extra: dict) -> None:
    """report.json, report.md and the fertility plot of a data folder being written (one process, or the
    cluster merge: the same bytes for the same corpus)."""
    full = {"fertility": report, "gates": [g.to_dict() for g in greport.results],
            "gate_options": {"fertility_floor": opt.fertility_floor, "fertility_ratio": opt.fertility_ratio,
                             "balance_range": list(opt.balance_range), "skip_gates": opt.skip_gates},
            "splits": stats, **sections, "memory": memory, **extra}
    _write_json(tmp / layout.DATA_REPORT, full)
    (tmp / layout.DATA_REPORT_MD).write_text(report_md(report, greport, stats, sections), encoding="utf-8")
    plot_report(report, tmp / FERTILITY_PNG, floor=opt.fertility_floor)


def finish(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an old DATA_DIR (with --force) goes only after that."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _given_tokenizer(opt: Options) -> Tokenizer | None:
    if opt.tokenizer is None:
        return None
    try:
        tok = Tokenizer.load(opt.tokenizer)
    except TokenizerError as e:
        raise PrepareError(str(e)) from None
    if opt.vocab_size is not None and opt.vocab_size != tok.vocab_size:
        raise PrepareError(f"--vocab-size {opt.vocab_size} differs from the --tokenizer's {tok.vocab_size}")
    return tok


def _extension_base(opt: Options) -> bytes | None:
    """--extend-tokenizer's base model, read and checked before any work."""
    if opt.extend_tokenizer is None:
        return None
    try:
        return vocab_extend.read_base(opt.extend_tokenizer)
    except vocab_extend.ExtendError as e:
        raise PrepareError(str(e)) from None


def _tokenizer(cr: CleanResult, opt: Options, keep: dict | None, given: Tokenizer | None,
               base: bytes | None = None) -> Tokenizer:
    if given is not None:
        return given
    sentences = sample_sentences(cr, opt, keep)
    if not sentences:
        raise PrepareError("no training sentences to train the tokenizer on")
    try:
        if base is not None:  # the base's pieces at their ids, then prodip's specials and the new pieces
            tok, added = vocab_extend.extended_tokenizer(base, sentences, opt.add_pieces, seed=opt.seed,
                                                         num_threads=opt.workers)
            if opt.echo:
                print(f"--extend-tokenizer {opt.extend_tokenizer}: {added} new pieces appended "
                      f"({tok.vocab_size} in all; --add-pieces {opt.add_pieces})")
            return tok
        return train_tokenizer(sentences, opt.vocab_size or DEFAULT_VOCAB_SIZE, seed=opt.seed, num_threads=opt.workers)
    except (vocab_extend.ExtendError, TokenizerError) as e:
        raise PrepareError(str(e)) from None
    except RuntimeError as e:  # SentencePiece: e.g. vocab_size too large for the text
        msg = str(e).strip().splitlines()[-1]
        raise PrepareError(f"tokenizer training failed: {msg.split('] ', 1)[-1]}") from None


def _base_fertility(cr: CleanResult, opt: Options, keep: dict | None, base: bytes | None) -> dict | None:
    if base is None:
        return None
    eval_docs = [d for d in cr.eval_sample.docs() if mix_kept(d, keep, opt.seed) is not None]
    report = fertility_report(vocab_extend.BaseTokenizer(base), eval_docs, target_char_share=opt.mix)
    if opt.echo:
        print(f"before extension ({opt.extend_tokenizer}):\n{format_table(report)}")
    return report


def _gates(tok: Tokenizer, cr: CleanResult, opt: Options, keep: dict | None) -> tuple[dict, GateReport]:
    """Fertility report on the held-out sample (after --mix) and the two gates; raises GateFailed."""
    eval_docs = [d for d in cr.eval_sample.docs() if mix_kept(d, keep, opt.seed) is not None]
    report = fertility_report(tok, eval_docs, target_char_share=opt.mix)
    report["held_out_docs"] = len(eval_docs)
    gates = fertility_gates(report, floor=opt.fertility_floor, ratio=opt.fertility_ratio,
                            balance_range=opt.balance_range)
    for g in gates:
        g.skipped = g.name in opt.skip_gates
    greport = GateReport(gates, skipped_by_user=list(opt.skip_gates))
    if opt.echo:
        print(format_table(report) + "\n\n" + greport.table())
    if not greport.passed:
        msgs = "; ".join(f"{g.name}: {g.detail}" for g in greport.failed)
        raise GateFailed(f"tokenizer gate failed, nothing written: {msgs} "
                         f"(change the tokenizer/vocabulary, or --skip-gate NAME to override)", report, gates)
    return report, greport


def prepare(inputs: list, out: Path, **options) -> dict:
    """Build DATA_DIR from `inputs`; return its meta.json content. Raises PrepareError/GateFailed."""
    opt = _options(options)
    out = Path(out)
    _check_out(out, opt.force)
    cfg = load_config(opt.quality)
    sources = resolve_sources(inputs)
    given = _given_tokenizer(opt)
    base = _extension_base(opt)
    eval_paths = resolve_eval_paths(opt.decontaminate, shipped=opt.shipped_eval_sets)
    eval_index = (EvalIndex.build(eval_paths, cfg.decontam["ngram_words"], cfg.decontam["min_words"])
                  if eval_paths else None)
    plan = plan_memory(opt.memory_gb, opt.workers, opt.shard_tokens, cfg.dedup["max_index_mb"], opt.dedup)
    opt.workers = plan.workers
    sources, skipped, total_bytes = validate_files(sources, opt)
    cr = clean_pass(sources, skipped, opt, cfg, eval_index, total_bytes, plan)
    if cr.n_raw == 0:
        raise PrepareError("no documents found in the inputs" + (
            f" ({len(skipped)} unreadable file(s) skipped)" if skipped else " (all files empty)"))
    keep = mix_keep_probabilities(opt.mix, cr.lang_chars) if opt.mix is not None else None
    n_kept = {s: st["n_docs"] for s, st in cr.kept.items()}
    if sum(n_kept.values()) == 0:
        raise PrepareError(f"no documents left after cleaning ({cr.n_raw} read; removed: {cr.dropped})")
    for split, n in n_kept.items():
        if n == 0:
            raise PrepareError(f"the {split} split is empty ({sum(n_kept.values())} documents kept); "
                               f"add text or change --val-fraction")
    tok = _tokenizer(cr, opt, keep, given, base)
    report, greport = _gates(tok, cr, opt, keep)
    before = _base_fertility(cr, opt, keep, base)
    sections = cleaning_sections(cr, opt, cfg, eval_index)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tok.save(tmp / layout.TOKENIZER)
        stats, kept_chars = encode_pass(cr, opt, keep, tok, tmp)
        for split, st in stats.items():
            if st["n_docs"] == 0:
                raise PrepareError(f"the {split} split is empty; add text or change --val-fraction")
        meta = _meta(inputs, cr, opt, tok, stats, kept_chars, keep, trained=given is None)
        _write_json(tmp / layout.DATA_META, meta)
        extra = {}
        if before is not None:  # the same held-out documents through the base tokenizer: before / after
            extra["fertility_before_extension"] = before
        if opt.num_shards > 1:
            extra["shard"] = meta["shard"]
        write_report(tmp, opt, report, greport, stats, sections, plan.to_dict(), extra)
        finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _meta(inputs: list, cr: CleanResult, opt: Options, tok: Tokenizer, stats: dict, kept_chars: dict,
          keep: dict | None, trained: bool) -> dict:
    meta = {
        "prodip_data": DATA_FORMAT_VERSION,
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok.sha256,
        "splits": stats,
        "inputs": [str(p) if str(p).startswith("hf:") else str(Path(p).resolve()) for p in inputs],
        "n_files": len(cr.sources),
        "skipped_files": cr.skipped,
        "documents": {"raw": cr.n_raw - cr.n_other_shards, "dropped": dict(sorted(cr.dropped.items()))},
        "options": {"mix": opt.mix, "val_fraction": opt.val_fraction, "seed": opt.seed,
                    "shard_tokens": opt.shard_tokens, "text_field": opt.text_field,
                    "max_sentences": opt.max_sentences, "trained_tokenizer": trained,
                    "filters": opt.filters, "dedup": opt.dedup, "near_dedup": opt.near_dedup},
    }
    if opt.num_shards > 1:
        meta["shard"] = {"index": opt.shard_index, "num_shards": opt.num_shards}
    if opt.mix is not None:
        named = sum(kept_chars[k] for k in opt.mix)
        meta["mix"] = {"target_char_share": opt.mix, "keep_probability": keep, "kept_chars": kept_chars,
                       "kept_char_share": {k: kept_chars[k] / named if named else 0.0 for k in opt.mix}}
    return meta

"""The last stage of `--executor ... --tasks N` (one task): the tasks' outputs in WORK become DATA_DIR,
byte for byte what one `python -m training.prepare` process writes from the same inputs and options.

    python -m training.prepare merge WORK --out DATA_DIR

Checked before anything is written: WORK's plan and tokenizer, every scan, dedup and encode task
finished (a missing one is named), and every task folder was written with the plan's tokenizer
and run (one from another is refused by name). Then: the report's counts, examples and held-out
sample in input order, the fertility gates, and the tasks' token streams cut into shards exactly as
one ShardWriter would have cut them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from training.data.shards import DataError, ShardWriter, read_header, read_shard
from training.prepare.clean import EXAMPLES_PER_REASON, MAX_CONTAMINATED_RECORDED, CleanResult, HeldOutSample
from training.prepare.cluster.cluster_plan import check_finished, options_from, read_plan, task_dir
from training.prepare.cluster.cluster_tasks import load_task
from training.prepare.cluster.worker_memory import EVAL_SAMPLE_CHARS, plan_memory
from training.prepare.errors import PrepareError
from training.prepare.options import Options
from training.prepare.pipeline import _check_out, _gates, _meta, _write_json, finish, write_report
from training.prepare.prepare_report import cleaning_sections
from training.prepare.quality import load_config
from training.runfiles import layout
from training.text.normalization import LANGUAGES
from training.text.tokenizer import Tokenizer

SPLITS = ("train", "val")


def _examples(reasons: list[list], found: list[tuple[int, str, str]]) -> dict[str, list[str]]:
    """Every dropped reason in first-drop order, with its first EXAMPLES_PER_REASON snippets."""
    out: dict[str, list[str]] = {r[0]: [] for r in reasons}
    for _, reason, snippet in sorted(found, key=lambda f: f[0]):
        if len(out[reason]) < EXAMPLES_PER_REASON:
            out[reason].append(snippet)
    return out


def _clean_result(opt: Options, scans: list[dict], dd: dict, encs: list[dict]) -> CleanResult:
    """The one-machine clean pass's result, assembled from the tasks' (counts summed, lists in order)."""
    reasons = dd["reasons"]
    offsets, n = [], 0
    for s in scans:
        offsets.append(n)
        n += s["n_raw"]
    found = [(off + i, reason, snip) for off, s, e in zip(offsets, scans, encs)
             for part in (s["examples"], e["examples"]) for reason, ex in part.items() for i, snip in ex]
    cr = CleanResult(sources=[name for s in scans for name in s["readable"]],
                     skipped=[k for s in scans for k in s["skipped"]], n_raw=n, kept=dd["kept"],
                     lang_chars=dd["lang_chars"], dropped={r[0]: r[1] for r in reasons},
                     dropped_chars={r[0]: r[2] for r in reasons}, examples=_examples(reasons, found),
                     contaminated=[{**c, "doc_index": off + c["doc_index"]} for off, s in zip(offsets, scans)
                                   for c in s["contaminated"]][:MAX_CONTAMINATED_RECORDED],
                     eval_sample=HeldOutSample(opt.eval_docs, EVAL_SAMPLE_CHARS), dedup=dd["dedup_stats"])
    for e in encs:
        for key, doc in e["sample"]:
            cr.eval_sample.offer(key, doc)
    return cr


def _eval_sets(scans: list[dict]) -> SimpleNamespace | None:
    """The decontamination sets with documents_removed summed over the tasks (None: none checked)."""
    sets = scans[0]["eval_sets"]
    if sets is None:
        return None
    out = [{**s, "documents_removed": sum(sc["removed_per_set"][i] for sc in scans)} for i, s in enumerate(sets)]
    return SimpleNamespace(sets=out)


def _shards(work: Path, tasks: int, tok: Tokenizer, opt: Options, encs: list[dict], tmp: Path) -> dict:
    """The tasks' tokens, in task order, through one ShardWriter per split: the one-machine cut."""
    stats = {s: {"n_tokens": 0, "n_shards": 0, "n_docs": 0, "n_bytes": 0, "n_chars": 0} for s in SPLITS}
    for split in SPLITS:
        w = ShardWriter(tmp / split, tok.vocab_size, tok.sha256, opt.shard_tokens)
        for t in range(tasks):
            for p in sorted((task_dir(work, "encode", t) / split).glob("shard_*.bin")):
                w.add(read_shard(p))
            for k in ("n_docs", "n_bytes", "n_chars"):
                stats[split][k] += encs[t]["stats"][split][k]
        w.close()
        stats[split]["n_tokens"], stats[split]["n_shards"] = int(w.n_tokens), int(w.n_shards)
        if stats[split]["n_docs"] == 0:
            raise PrepareError(f"the {split} split is empty; add text or change --val-fraction")
    return stats


def _check_shards(work: Path, tasks: int, tok: Tokenizer) -> None:
    """Every task shard's header names the plan's tokenizer (checked before anything is written)."""
    for t in range(tasks):
        for p in sorted(task_dir(work, "encode", t).glob("*/shard_*.bin")):
            try:
                sha = read_header(p).tokenizer_sha256
            except DataError as e:
                raise PrepareError(f"merge: {e}") from None
            if sha != tok.sha256:
                raise PrepareError(f"merge: {p} was encoded with another tokenizer (sha256 {sha[:12]}…) than "
                                   f"{work}/tokenizer.model ({tok.sha256[:12]}…); refused")


def merge_tasks(work: Path, out: Path, *, force: bool = False, echo: bool = False) -> dict:
    """WORK's finished tasks -> `out`; return its meta.json content. Raises PrepareError/GateFailed."""
    work, out = Path(work), Path(out)
    plan = read_plan(work)
    for stage in ("scan", "dedup", "encode"):
        check_finished(work, plan, stage, "merge")
    _check_out(out, force)
    opt = options_from(plan, echo=echo)
    cfg = load_config(opt.quality)
    tok = Tokenizer.load(work / "tokenizer.model")
    scans = [load_task(work, "scan", t)[0] for t in range(plan["tasks"])]
    encs = [load_task(work, "encode", t)[0] for t in range(plan["tasks"])]
    dd = load_task(work, "dedup", 0)[0]
    _check_shards(work, plan["tasks"], tok)
    cr = _clean_result(opt, scans, dd, encs)
    keep = dd["mix_keep"]
    report, greport = _gates(tok, cr, opt, keep)
    sections = cleaning_sections(cr, opt, cfg, _eval_sets(scans))  # type: ignore[arg-type]
    mem = plan_memory(opt.memory_gb, opt.workers, opt.shard_tokens, cfg.dedup["max_index_mb"], opt.dedup)
    kept_chars = {lang: sum(e["kept_chars"][lang] for e in encs) for lang in LANGUAGES}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tok.save(tmp / layout.TOKENIZER)
        stats = _shards(work, plan["tasks"], tok, opt, encs, tmp)
        meta = _meta(plan["inputs"], cr, opt, tok, stats, kept_chars, keep, trained=False)
        _write_json(tmp / layout.DATA_META, meta)
        write_report(tmp, opt, report, greport, stats, sections, mem.to_dict(), {})
        finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta

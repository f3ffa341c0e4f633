"""`python -m training.prepare merge SHARD_DIR ... --out DATA_DIR`: the data folders that N machines
wrote with --shard-index i --num-shards N become one data folder the trainer reads.

Checked before anything is written: every folder is a prepared data folder of this format, all
name the same tokenizer (meta.json and the sha256 of each tokenizer.model), the same options that
decide which documents are kept and where (seed, val-fraction, text field, filters), the same
--num-shards, every index exactly once, and each shard file's header agrees with meta.json's
counts. Shard files are hard-linked (copied across file systems) in index order and renumbered;
the fertility report is recomputed from the summed per-language counts and the gates re-run.
Exact duplicates never cross shards (a document's shard is a hash of its text); near-duplicates
across shards are not checked (report.json says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from training.data.shards import DataError, read_header
from training.gates import GateReport
from training.prepare.cluster.cluster_merge import merge_tasks
from training.prepare.cluster.cluster_plan import PLAN
from training.prepare.errors import GateFailed, PrepareError
from training.prepare.options import DATA_FORMAT_VERSION
from training.prepare.pipeline import _check_out, finish
from training.prepare.prepare_report import report_md
from training.runfiles import layout
from training.runfiles.file_ops import Input, check_apart
from training.text.fertility import fertility_gates, report_from_counts

SAME_OPTIONS = ("seed", "val_fraction", "text_field", "filters", "dedup", "near_dedup")
SUMMED = ("n_tokens", "n_shards", "n_docs", "n_bytes", "n_chars")


def _read(folder: Path) -> tuple[dict, dict]:
    if not folder.is_dir():
        raise PrepareError(f"merge: not a folder: {folder}")
    try:
        return (layout.read_json(folder / layout.DATA_META, "data meta"),
                layout.read_json(folder / layout.DATA_REPORT, "data report"))
    except layout.LayoutError as e:
        raise PrepareError(f"merge: {e}") from None


def _check_shard_files(folder: Path, meta: dict) -> dict[str, list[Path]]:
    files = {}
    for split in layout.SPLITS:
        paths = sorted((folder / split).glob("shard_*.bin"))
        st = meta["splits"][split]
        if len(paths) != st["n_shards"]:
            raise PrepareError(f"merge: {folder}/{split} has {len(paths)} shard files, meta.json says {st['n_shards']}")
        try:
            headers = [read_header(p) for p in paths]
        except DataError as e:
            raise PrepareError(f"merge: {e}") from None
        if sum(h.n_tokens for h in headers) != st["n_tokens"]:
            raise PrepareError(f"merge: {folder}/{split}: shard headers hold {sum(h.n_tokens for h in headers)} "
                               f"tokens, meta.json says {st['n_tokens']}")
        bad = [p for p, h in zip(paths, headers) if h.tokenizer_sha256 != meta["tokenizer_sha256"]]
        if bad:
            raise PrepareError(f"merge: {bad[0]} was encoded with another tokenizer than its meta.json names")
        files[split] = paths
    return files


def _validate(folders: list[Path]) -> list[tuple[Path, dict, dict]]:
    if not folders:
        raise PrepareError("merge: give the shard folders to merge")
    items = [(f, *_read(f)) for f in folders]
    f0, m0, _ = items[0]
    for f, m, _ in items:
        if m.get("prodip_data") != DATA_FORMAT_VERSION:
            raise PrepareError(f"merge: {f}: data format {m.get('prodip_data')}, this prodip writes {DATA_FORMAT_VERSION}")
        if "shard" not in m:
            raise PrepareError(f"merge: {f} is not a shard (prepared without --num-shards)")
        sha = hashlib.sha256((f / layout.TOKENIZER).read_bytes()).hexdigest() if (f / layout.TOKENIZER).is_file() else None
        if m["tokenizer_sha256"] != m0["tokenizer_sha256"] or sha != m0["tokenizer_sha256"]:
            raise PrepareError(f"merge: {f} was encoded with another tokenizer (sha256 {str(sha)[:12]}…) than "
                               f"{f0} ({m0['tokenizer_sha256'][:12]}…)")
        for k in SAME_OPTIONS:
            if m["options"].get(k) != m0["options"].get(k):
                raise PrepareError(f"merge: {f} used {k}={m['options'].get(k)!r}, {f0} used {m0['options'].get(k)!r}")
        if m["shard"]["num_shards"] != m0["shard"]["num_shards"]:
            raise PrepareError(f"merge: {f} is one of {m['shard']['num_shards']} shards, {f0} one of "
                               f"{m0['shard']['num_shards']}")
    n = m0["shard"]["num_shards"]
    got = sorted(m["shard"]["index"] for _, m, _ in items)
    if got != list(range(n)):
        missing = sorted(set(range(n)) - set(got))
        dup = sorted({i for i in got if got.count(i) > 1})
        raise PrepareError(f"merge: need shards 0..{n - 1} exactly once; missing {missing}, repeated {dup}")
    return sorted(items, key=lambda it: it[1]["shard"]["index"])


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _merged_report(reports: list[dict], stats: dict) -> tuple[dict, GateReport]:
    counts: dict[str, dict[str, int]] = {}
    for r in reports:
        for lang, v in r["fertility"]["languages"].items():
            c = counts.setdefault(lang, {"n_docs": 0, "chars": 0, "bytes": 0, "tokens": 0})
            for k in c:
                c[k] += v[k]
    f0 = reports[0]["fertility"]
    fert = report_from_counts(counts, vocab_size=f0["vocab_size"], tokenizer_sha256=f0["tokenizer_sha256"],
                              target_char_share=f0.get("target_char_share"))
    fert["held_out_docs"] = sum(r["fertility"].get("held_out_docs", 0) for r in reports)
    go = reports[0]["gate_options"]
    gates = fertility_gates(fert, floor=go["fertility_floor"], ratio=go["fertility_ratio"],
                            balance_range=tuple(go["balance_range"]))
    for g in gates:
        g.skipped = g.name in go["skip_gates"]
    return fert, GateReport(gates, skipped_by_user=list(go["skip_gates"]))


def _sum_sections(reports: list[dict]) -> dict:
    out = json.loads(json.dumps({k: reports[0][k] for k in ("documents", "quality", "dedup", "decontamination")}))
    for r in reports[1:]:
        for k in ("raw", "kept", "dropped"):
            out["documents"][k] += r["documents"][k]
        for key in ("dropped_by_reason", "dropped_chars_by_reason"):
            for reason, n in r["documents"][key].items():
                out["documents"][key][reason] = out["documents"][key].get(reason, 0) + n
        for reason, n in r["quality"]["dropped"].items():
            out["quality"]["dropped"][reason] = out["quality"]["dropped"].get(reason, 0) + n
        for k in ("exact_duplicates", "near_duplicates"):
            out["dedup"][k] += r["dedup"][k]
        by_sha = {s["sha256"]: s for s in out["decontamination"]["sets"]}
        for s in r["decontamination"]["sets"]:
            if s["sha256"] in by_sha:
                by_sha[s["sha256"]]["documents_removed"] += s["documents_removed"]
            else:
                out["decontamination"]["sets"].append(s)
        out["decontamination"]["documents_removed"] += r["decontamination"]["documents_removed"]
        out["decontamination"]["removed"] += r["decontamination"]["removed"]
    out["dedup"]["near_duplicates_across_shards"] = "not checked"
    return out


def merge(folders: list[Path], out: Path, *, force: bool = False) -> dict:
    """Merge shard data folders into `out`; return its meta.json content. Raises PrepareError.
    One folder holding a task plan is an --executor run's WORK: its finished tasks are merged."""
    out = Path(out)
    if len(folders) == 1 and (Path(folders[0]) / PLAN).is_file():
        return merge_tasks(Path(folders[0]), out, force=force, echo=True)
    check_apart("--out", out, [Input("SHARD_DIR", f) for f in folders], PrepareError)  # --force deletes an old out
    _check_out(out, force)
    items = _validate([Path(f) for f in folders])
    files = [_check_shard_files(f, m) for f, m, _ in items]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        shutil.copy2(items[0][0] / layout.TOKENIZER, tmp / layout.TOKENIZER)
        stats = {s: dict.fromkeys(SUMMED, 0) for s in layout.SPLITS}
        for split in layout.SPLITS:
            (tmp / split).mkdir()
            n = 0
            for (_, m, _), fs in zip(items, files):
                for p in fs[split]:
                    _link(p, tmp / split / f"shard_{n:05d}.bin")
                    n += 1
                for k in SUMMED:
                    stats[split][k] += m["splits"][split][k]
        reports = [r for _, _, r in items]
        fert, greport = _merged_report(reports, stats)
        if not greport.passed:
            msgs = "; ".join(f"{g.name}: {g.detail}" for g in greport.failed)
            raise GateFailed(f"tokenizer gate failed on the merged counts, nothing written: {msgs}", fert,
                             greport.results)
        sections = _sum_sections(reports)
        m0 = items[0][1]
        meta = {**m0, "splits": stats, "inputs": sorted({i for _, m, _ in items for i in m["inputs"]}),
                "n_files": max(m["n_files"] for _, m, _ in items),
                "skipped_files": [s for _, m, _ in items for s in m["skipped_files"]][:1000],
                "documents": {"raw": sections["documents"]["raw"],
                              "dropped": sections["documents"]["dropped_by_reason"]},
                "merged_from": [{"path": str(f.resolve()), "index": m["shard"]["index"]} for f, m, _ in items]}
        meta.pop("shard", None)
        meta.pop("mix", None)  # per-shard keep probabilities differ; each shard's meta.json keeps its own
        (tmp / layout.DATA_META).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        full = {"fertility": fert, "gates": [g.to_dict() for g in greport.results],
                "gate_options": reports[0]["gate_options"], "splits": stats, **sections,
                "merged_from": meta["merged_from"]}
        (tmp / layout.DATA_REPORT).write_text(json.dumps(full, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp / layout.DATA_REPORT_MD).write_text(report_md(fert, greport, stats, sections), encoding="utf-8")
        finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta

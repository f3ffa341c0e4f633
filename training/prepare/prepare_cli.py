"""The command line of training.prepare (one parser for every documented command).

    python -m training.prepare --input PATH|hf:NAME[:CONFIG][:SPLIT] [--input ...] --out DATA_DIR [options]
    python -m training.prepare merge SHARD_DIR [SHARD_DIR ...] --out DATA_DIR [--force]

Errors go through training.runfiles.cli_harness.run_main: one `error:` line and exit 2 (a failed gate: exit 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from training.prepare.cluster.executor_flags import (
    CLUSTER_FLAGS,
    add_cluster_flags,
    add_task_parser,
    cluster_options,
)
from training.prepare.cluster.worker_memory import DEFAULT_MEMORY_GB
from training.prepare.decontam import SHIPPED_EVAL_SETS
from training.prepare.errors import GateFailed, PrepareError
from training.prepare.merge import merge
from training.prepare.options import (
    DEFAULT_EVAL_DOCS,
    DEFAULT_MAX_SENTENCES,
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    OPTION_TYPES,
    check_places,
)
from training.prepare.pipeline import _options as checked_options
from training.prepare.pipeline import prepare
from training.prepare.sources import TEXT_FIELD
from training.runfiles.cli_harness import ArgumentParser, run_main
from training.runfiles.schema import PositiveFloat, SchemaError, flag, one_of, parse
from training.store.urls import local_path, local_text
from training.text.fertility import (
    DEFAULT_BALANCE_RANGE,
    DEFAULT_FERTILITY_FLOOR,
    DEFAULT_FERTILITY_RATIO,
    GATE_NAMES,
)

EXIT_GATE = 1
NOT_OPTIONS = ("command", "input", "out", "skip_gate", "no_progress", "debug", "no_filters", "no_dedup",
               "no_near_dedup", "no_shipped_eval", "shards", *CLUSTER_FLAGS)


def _typed(option: str):
    """The argparse type of an option: its schema type from OPTION_TYPES."""
    return flag(OPTION_TYPES[option][1])


def _pair(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LO,HI like 0.8,1.25, got {text!r}")
    try:
        lo, hi = (parse(PositiveFloat, x.strip(), name) for x, name in zip(parts, ("LO", "HI"), strict=True))
    except SchemaError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return lo, hi


def _gate(text: str) -> str:
    try:
        return one_of("gate", text, GATE_NAMES)
    except SchemaError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_cleaning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quality", type=local_path, default=None, metavar="FILE.toml",
                   help="quality rules, dedup and decontamination settings (default: training/prepare/quality.toml)")
    p.add_argument("--no-filters", action="store_true", help="turn the quality rules off")
    p.add_argument("--no-dedup", action="store_true", help="keep exact and near duplicates")
    p.add_argument("--no-near-dedup", action="store_true", help="remove exact duplicates only")
    p.add_argument("--decontaminate", action="append", default=[], type=local_path, metavar="PATH",
                   help="eval text/JSONL/JSON file or folder: training documents overlapping it are removed "
                        "(repeatable; the shipped SFT set is always checked)")
    p.add_argument("--no-shipped-eval", action="store_true",
                   help="do not check against the SFT set shipped in training/assets/chat")
    p.add_argument("--shard-index", type=_typed("shard_index"), default=0, metavar="I",
                   help="this machine's shard (0-based)")
    p.add_argument("--num-shards", type=_typed("num_shards"), default=1, metavar="N",
                   help="machines sharing the work (each writes its own DATA_DIR; then `merge`)")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m training.prepare",
                       description="Corpus -> cleaned, deduplicated, decontaminated token shards + "
                                   "tokenizer + report, behind the tokenizer gates.")
    p.add_argument("--input", action="append", default=None, metavar="PATH", type=local_text,
                   help="file or folder (repeatable): .txt/.md, .jsonl, .parquet, .gz; or hf:NAME[:CONFIG][:SPLIT]")
    p.add_argument("--out", type=local_path, metavar="DATA_DIR")
    p.add_argument("--vocab-size", type=_typed("vocab_size"), default=None, metavar="N",
                   help=f"tokenizer vocabulary (default {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--tokenizer", type=local_path, default=None, metavar="FILE", help="use this tokenizer.model instead of training one")
    p.add_argument("--extend-tokenizer", type=local_path, default=None, metavar="BASE",
                   help="append pieces trained on the corpus to this tokenizer.model (an imported model's; ids of "
                        "its pieces unchanged) and use the result (docs/init_from.md)")
    p.add_argument("--add-pieces", type=_typed("add_pieces"), default=None, metavar="N",
                   help="with --extend-tokenizer: how many new pieces")
    p.add_argument("--mix", default=None, metavar="LANG=SHARE,...", help="target character shares, e.g. bn=0.8,en=0.2 (down-samples)")
    p.add_argument("--val-fraction", type=_typed("val_fraction"), default=DEFAULT_VAL_FRACTION, metavar="F",
                   help="share of documents held out (by hash of their text)")
    p.add_argument("--seed", type=_typed("seed"), default=0)
    p.add_argument("--force", action="store_true", help="replace an existing DATA_DIR")
    p.add_argument("--strict", action="store_true", help="an unreadable input file is an error, not skipped")
    p.add_argument("--shard-tokens", type=_typed("shard_tokens"), default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help="tokens per shard file")
    p.add_argument("--workers", type=_typed("workers"), default=None, metavar="N",
                   help="worker processes (default: all cores, as many as --memory-gb fits)")
    p.add_argument("--memory-gb", type=_typed("memory_gb"), default=DEFAULT_MEMORY_GB, metavar="GB",
                   help=f"memory of the main process and all workers together, GiB (default {DEFAULT_MEMORY_GB:g}): "
                        "sets the worker count and the dedup index size")
    p.add_argument("--text-field", default=TEXT_FIELD, help="JSONL field / Parquet or dataset column holding the text")
    p.add_argument("--max-sentences", type=_typed("max_sentences"), default=DEFAULT_MAX_SENTENCES,
                   help="sentences sampled to train the tokenizer")
    p.add_argument("--eval-docs", type=_typed("eval_docs"), default=DEFAULT_EVAL_DOCS,
                   help="held-out documents sampled for the fertility report")
    p.add_argument("--fertility-floor", type=_typed("fertility_floor"), default=DEFAULT_FERTILITY_FLOOR,
                   help="minimum Bangla characters/token")
    p.add_argument("--fertility-ratio", type=_typed("fertility_ratio"), default=DEFAULT_FERTILITY_RATIO,
                   help="minimum Bangla fertility as a fraction of English's")
    p.add_argument("--balance-range", type=_pair, default=DEFAULT_BALANCE_RANGE, metavar="LO,HI",
                   help="allowed token share / character share per language (LO,HI)")
    p.add_argument("--skip-gate", action="append", default=[], metavar="NAME", type=_gate,
                   help=f"record this gate as skipped instead of failing (repeatable): {', '.join(GATE_NAMES)}")
    _add_cleaning(p)
    add_cluster_flags(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="{merge,task}")
    m = sub.add_parser("merge", help="merge the DATA_DIRs of --num-shards machines (or the WORK of --executor) into one",
                       description="Check tokenizer hash, format and counts of shard data folders, or the finished "
                                   "tasks of an --executor run's WORK folder; write one data folder.")
    m.add_argument("shards", nargs="+", type=local_path, metavar="SHARD_DIR")
    m.add_argument("--out", type=local_path, required=True, metavar="DATA_DIR")
    m.add_argument("--force", action="store_true", help="replace an existing DATA_DIR")
    m.add_argument("--debug", action="store_true", help="show tracebacks")
    add_task_parser(sub)
    return p


def _summary(meta: dict, out: Path, seconds: float) -> str:
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    docs = meta.get("documents", {})
    dropped = ", ".join(f"{k} {v:,}" for k, v in docs.get("dropped", {}).items()) or "none"
    return (f"\nwrote {out}: train {tr['n_tokens']:,} tokens in {tr['n_shards']} shard(s) ({tr['n_docs']:,} docs), "
            f"val {va['n_tokens']:,} tokens ({va['n_docs']:,} docs), vocab {meta['vocab_size']}, "
            f"{len(meta['skipped_files'])} file(s) skipped, {seconds:.1f} s\nremoved documents: {dropped}")


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    t0 = time.perf_counter()
    if args.command == "merge":  # merge checks its --out against the SHARD_DIRs itself
        meta = merge(args.shards, args.out, force=args.force)
        print(_summary(meta, args.out, time.perf_counter() - t0))
        return 0
    if args.command == "task":  # inside a job that --executor slurm submitted
        from training.prepare.cluster.executors import run_task

        run_task(args.stage, args.work, args.workers, args.force)
        return 0
    if not args.input or args.out is None:
        raise PrepareError("the following arguments are required: --input, --out")
    x = cluster_options(args)
    opts = {k: v for k, v in vars(args).items() if k not in NOT_OPTIONS}
    # bars only on a terminal: in a log file or CI they would be noise around the one-line errors
    opts.update(skip_gates=args.skip_gate, progress=not args.no_progress and sys.stderr.isatty(), echo=True, filters=not args.no_filters,
                dedup=not args.no_dedup, near_dedup=not args.no_near_dedup, shipped_eval_sets=not args.no_shipped_eval)
    # every option's value first (a bad --mix is named as such), then --out against every input
    check_places(args.input, args.out, checked_options(dict(opts)), () if args.no_shipped_eval else SHIPPED_EVAL_SETS)
    if x is not None:
        from training.prepare.cluster.executors import run_cluster  # datatrove: only when --executor is given

        meta = run_cluster(args.input, args.out, opts, x)
        if meta is None:  # submitted to Slurm: the merge job writes DATA_DIR
            return 0
    else:
        meta = prepare(args.input, args.out, **opts)
    print(_summary(meta, args.out, time.perf_counter() - t0))
    if "mix" in meta:
        kept = ", ".join(f"{k} {v:.1%} (target {meta['mix']['target_char_share'][k]:.1%})"
                         for k, v in meta["mix"]["kept_char_share"].items())
        print(f"--mix: character shares of all kept documents: {kept}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()

    def go(args: argparse.Namespace) -> int:
        try:
            return _run(args, parser)
        except GateFailed as e:
            if args.debug:
                raise
            print(f"error: {e}", file=sys.stderr)
            return EXIT_GATE

    return run_main(parser, argv, go)  # PrepareError, TokenizerError, LayoutError, SchemaError: ValueErrors

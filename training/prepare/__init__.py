"""training.prepare: corpus -> cleaned, deduplicated, decontaminated token shards + tokenizer + report.

    python -m training.prepare --input CORPUS|hf:NAME[:CONFIG][:SPLIT] [--input ...] --out DATA_DIR
    python -m training.prepare merge SHARD_DIR ... --out DATA_DIR

Modules, by concern: sources (files, JSONL, Parquet, hf: datasets) · quality (rules, quality.toml)
· dedup (exact + MinHash LSH, bounded index) · decontam (eval n-gram overlap, status_for) · clean
(pass 1) · sample (tokenizer sentences) · encode (pass 3, shards) · merge · prepare_report · pipeline
(prepare()) · prepare_cli (+ __main__) · cluster/ (executors, the local pool, worker memory, cluster runs). docs/data.md and docs/tokenizer.md describe the behaviour.
"""

from training.prepare.decontam import status_for
from training.prepare.errors import GateFailed, PrepareError
from training.prepare.merge import merge
from training.prepare.options import Options, mix_keep_probabilities, parse_mix
from training.prepare.pipeline import prepare
from training.prepare.prepare_cli import build_parser, main
from training.prepare.sources import iter_file_docs, resolve_inputs
from training.text.fertility import GATE_NAMES

__all__ = ["GATE_NAMES", "GateFailed", "Options", "PrepareError", "build_parser", "iter_file_docs", "main", "merge",
           "mix_keep_probabilities", "parse_mix", "prepare", "resolve_inputs", "status_for"]

"""--memory-gb: one memory budget for the main process and all its workers, split before the run.

Every structure that grows with the corpus gets a fixed bound here, at the start, so peak memory
follows the budget, not the corpus size:

    main process   MAIN_BASE_MB      interpreter, numpy, PyTorch (shard writer), chunks in flight
                   held-out sample   at most EVAL_SAMPLE_CHARS characters (the fertility report)
                   dedup index       one fixed table: what is left, at most quality.toml's max_index_mb
                   shard buffers     2 splits x 2 x --shard-tokens x 4 bytes (a buffer and the shard
                                     cut from it); they live in the encode pass, after the index is freed
    workers        WORKER_MB each    interpreter, numpy, datasketch, SentencePiece, word-hash cache

Workers that do not fit are not started (a warning says so). Constants are measured upper bounds
(tests/benchmarks/bench_prepare.py samples every process). Outside the budget: training a
tokenizer (no --tokenizer), bounded by --max-sentences rather than by the corpus, and 1 byte per
raw document (the keep mask the later passes read: 3 MB for 3 M documents).
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

from training.prepare.cluster.pool import resolve_workers
from training.prepare.errors import PrepareError

DEFAULT_MEMORY_GB = 2.0
MAIN_BASE_MB = 400
WORKER_MB = 120
EVAL_SAMPLE_CHARS = 1 << 23  # 8 M characters: <= 16 MiB as Python str (2 bytes per Bangla char)
EVAL_SAMPLE_MB = 32  # the sample and its tokenization for the fertility report
MIN_INDEX_MB = 64  # below this the index fills after ~0.4 M documents: refuse rather than dedup badly
TOKEN_BYTES = 4  # the widest shard dtype (uint32 for vocabularies over 65,536)


@dataclass(frozen=True)
class MemoryPlan:
    budget_mb: int
    workers: int
    index_mb: int  # the dedup index (clean pass)
    shard_buffer_mb: int  # the encode pass's buffers, at most
    eval_sample_chars: int
    main_base_mb: int = MAIN_BASE_MB
    worker_mb: int = WORKER_MB

    def to_dict(self) -> dict:
        return asdict(self)


def plan_memory(memory_gb: float, workers: int | None, shard_tokens: int, max_index_mb: int,
                dedup: bool = True) -> MemoryPlan:
    """Split `memory_gb` (GiB) between main process, workers (None: all cores, as many as fit) and
    the dedup index. Raises PrepareError when even one worker and the smallest index do not fit."""
    asked = workers is not None
    workers = resolve_workers(workers)
    budget = int(memory_gb * 1024)
    buffers = math.ceil(2 * 2 * shard_tokens * TOKEN_BYTES / (1 << 20))
    fixed = MAIN_BASE_MB + EVAL_SAMPLE_MB
    # the index and the shard buffers never coexist (the index is freed when the clean pass ends)
    phase = max(MIN_INDEX_MB if dedup else 0, buffers)
    fit = (budget - fixed - phase) // WORKER_MB
    if fit < 1:
        need = (fixed + phase + WORKER_MB) / 1024
        raise PrepareError(f"--memory-gb {memory_gb:g} is too small: one worker, the main process and "
                           f"--shard-tokens {shard_tokens:,} need {need:.2f} GB")
    if asked and fit < workers:
        print(f"warning: --memory-gb {memory_gb:g} fits {fit} worker(s) of {WORKER_MB} MiB; using {fit} "
              f"of the {workers} asked for (raise --memory-gb to use more)", file=sys.stderr)
    n = min(workers, fit)
    index = min(max_index_mb, budget - fixed - n * WORKER_MB) if dedup else 0
    return MemoryPlan(budget_mb=budget, workers=n, index_mb=index, shard_buffer_mb=buffers,
                      eval_sample_chars=EVAL_SAMPLE_CHARS)

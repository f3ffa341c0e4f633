"""Bounded memory in training.prepare: every structure that grows with the corpus stops at a cap
fixed before the run (the dedup index, the held-out sample, the shard buffer), the caps only bound
memory (what is indexed still catches its copies), and --memory-gb splits one budget between the
main process and its workers. The measured proof at two corpus sizes is tests/benchmarks/bench_prepare.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import CORPUS

from training.data.loaders import ShardWriter, read_shard
from training.prepare import PrepareError, main, prepare
from training.prepare.clean import HeldOutSample
from training.prepare.cluster.worker_memory import MAIN_BASE_MB, WORKER_MB, plan_memory
from training.prepare.dedup import DedupIndex
from training.prepare.options import DEFAULT_SHARD_TOKENS

BANDS = 14
N_DOCS = 20_000  # about 3x what a 1 MiB index holds
CAP_MB = 1


def planted_stream(seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """Exact and band keys of N_DOCS distinct documents, with an exact copy and a near copy (new exact
    key, 4 of 14 bands shared) of one of the first 100 documents planted every 100 documents; the expected verdicts."""
    rng = np.random.default_rng(seed)
    exact = rng.integers(1, 2**63, N_DOCS, dtype=np.uint64)
    bands = rng.integers(1, 2**63, (N_DOCS, BANDS), dtype=np.uint64)
    want: list[str | None] = [None] * N_DOCS
    for i in range(100, N_DOCS, 100):
        src = int(rng.integers(0, 99))  # a copy of one of the first 100 documents
        exact[i], bands[i] = exact[src], bands[src]
        want[i] = "exact_duplicate"
        bands[i + 1, :4] = bands[src + 1, :4]
        want[i + 1] = "near_duplicate"
    return exact, bands, want


def run_index(index: DedupIndex, exact: np.ndarray, bands: np.ndarray, chunk: int = 300) -> list[str | None]:
    arrays = (index.exact.slots, index.bands.slots)
    out: list[str | None] = []
    for i in range(0, len(exact), chunk):
        out += index.check_chunk(exact[i: i + chunk], bands[i: i + chunk])
        assert index.nbytes <= index.max_bytes, "the index outgrew its cap"
        assert index.exact.slots is arrays[0] and index.bands.slots is arrays[1], "a table was reallocated"
    return out


def test_dedup_index_stays_within_its_cap_and_still_catches_copies():
    exact, bands, want = planted_stream()
    capped = DedupIndex(CAP_MB, near=True, bands=BANDS)
    got = run_index(capped, exact, bands)
    st = capped.stats()
    assert st["index_bytes"] <= CAP_MB << 20
    assert st["index_full_after_docs"] is not None and st["indexed_docs"] < N_DOCS // 2  # the cap was hit
    assert got == want  # copies of indexed documents are still caught after the index is full
    roomy = DedupIndex(64, near=True, bands=BANDS)
    assert run_index(roomy, exact, bands) == want and roomy.stats()["index_full_after_docs"] is None


def test_exact_only_index_gives_all_memory_to_exact_keys():
    idx = DedupIndex(CAP_MB, near=False)
    assert idx.bands is None and idx.nbytes == CAP_MB << 20
    assert idx.capacity_docs == int(0.75 * (CAP_MB << 20) // 8)


def test_held_out_sample_is_bounded_and_independent_of_order():
    rng = random.Random(0)
    docs = [(rng.getrandbits(64), "ক" * rng.randint(1, 400)) for _ in range(3000)]
    max_docs, max_chars = 200, 20_000
    # the longest prefix in key order that fits both limits
    want, chars = [], 0
    for _key, d in sorted(docs):
        if len(want) == max_docs or chars + len(d) > max_chars:
            break
        want.append(d)
        chars += len(d)
    for order in (docs, list(reversed(docs)), rng.sample(docs, len(docs))):
        s = HeldOutSample(max_docs, max_chars)
        for key, d in order:
            s.offer(key, d)
            assert s.chars <= max_chars and len(s.heap) <= max_docs
        assert s.docs() == want


def test_shard_buffer_never_holds_a_whole_shard(tmp_path):
    shard_tokens = 1000
    w = ShardWriter(tmp_path, 2048, "0" * 64, shard_tokens)
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 2048, rng.integers(1, 3 * shard_tokens)).astype(np.uint16) for _ in range(50)]
    for p in parts:
        w.add(p)
        assert w.buffered < shard_tokens
    w.close()
    files = sorted(tmp_path.glob("shard_*.bin"))
    assert all(len(read_shard(f)) <= shard_tokens for f in files)
    assert np.array_equal(np.concatenate([read_shard(f) for f in files]), np.concatenate(parts))


def test_memory_plan_fits_main_and_workers_in_the_budget(capsys):
    p = plan_memory(2.0, 16, DEFAULT_SHARD_TOKENS, 1024)
    assert 1 <= p.workers < 16  # 16 workers do not fit in 2 GB: fewer are started, and a warning says so
    assert f"warning: --memory-gb 2 fits {p.workers} worker(s)" in capsys.readouterr().err
    assert MAIN_BASE_MB + p.workers * WORKER_MB + p.index_mb <= p.budget_mb == 2048
    assert MAIN_BASE_MB + p.workers * WORKER_MB + p.shard_buffer_mb <= p.budget_mb  # the encode pass too
    big = plan_memory(64.0, 16, DEFAULT_SHARD_TOKENS, 1024)
    assert big.workers == 16 and big.index_mb == 1024  # the index is capped by quality.toml's max_index_mb
    assert plan_memory(2.0, 2, DEFAULT_SHARD_TOKENS, 1024).index_mb == 1024
    with pytest.raises(PrepareError, match="--memory-gb 0.5 is too small"):
        plan_memory(0.5, 2, DEFAULT_SHARD_TOKENS, 1024)


def test_memory_gb_flag(tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["--input", str(CORPUS), "--out", str(out), "--memory-gb", "0.3", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --memory-gb 0.3 is too small") and not out.exists()
    meta = prepare([CORPUS], out, vocab_size=1024, fertility_floor=1.5, progress=False, workers=1,
                   memory_gb=1.5, shard_tokens=100_000)
    rep = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert rep["memory"]["budget_mb"] == 1536 and rep["memory"]["workers"] == 1
    assert rep["dedup"]["index_bytes"] <= rep["memory"]["index_mb"] << 20
    assert meta["splits"]["train"]["n_tokens"] > 0


def test_a_full_dedup_index_is_said_loudly(tmp_path, capsys):
    """More kept documents than a 1 MiB index holds (~6.5 k): the run still completes, but the copies it
    could no longer catch are not silent: one warning line naming --memory-gb, and report.json/.md say so."""
    words = sorted({w for f in sorted(CORPUS.rglob("*.txt")) for w in f.read_text(encoding="utf-8").split()})
    rng = random.Random(0)
    n = 9_000
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=40))}, ensure_ascii=False) + "\n"
                            for _ in range(n)), encoding="utf-8")
    quality = tmp_path / "quality.toml"
    quality.write_text("[dedup]\nmax_index_mb = 1\n", encoding="utf-8")
    out = tmp_path / "data"
    prepare([docs], out, vocab_size=1024, fertility_floor=1.0, progress=False, workers=1, quality=quality,
            filters=False)
    err = [line for line in capsys.readouterr().err.splitlines() if "dedup index" in line]
    assert len(err) == 1 and err[0].startswith("warning: the dedup index (1 MiB) filled after "), err
    assert f"of {n:,} kept documents" in err[0] and "--memory-gb" in err[0]
    d = json.loads((out / "report.json").read_text(encoding="utf-8"))["dedup"]
    assert 0 < d["index_full_after_docs"] == d["indexed_docs"] < n and d["index_capacity_docs"] < n
    assert "**Deduplication incomplete:** the dedup index (1 MiB) filled" in (out / "report.md").read_text(encoding="utf-8")

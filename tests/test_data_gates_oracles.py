"""training/gates/data_gates.py on hand-built token streams and loaders (a few dozen tokens, no prepared data):
the largest id against the vocabulary (an id equal to the vocabulary size is out), repeated windows
by position, validation windows sharing a span with training, the hash and chunking arithmetic.
Expectations are written from the gates' definitions, never read back from the code."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import training.gates.data_gates as D


class Loader:
    """Yields the given (x, y) batches in order; state_dict/load_state_dict save and restore the position."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], stream: object | None = None) -> None:
        self.batches, self.pos, self.asked = batches, 0, []
        if stream is not None:
            self.stream = stream

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.pos = s["pos"]

    def next_batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.asked.append(n)
        b = self.batches[self.pos % len(self.batches)]
        self.pos += 1
        return b


class Stream:
    def __init__(self, *parts: list[int]) -> None:
        self.parts = [np.asarray(p, dtype=np.int64) for p in parts]
        self.paths = [Path(f"shard_{i}.bin") for i in range(len(parts))]
        self.all = np.concatenate(self.parts)
        self.n_tokens = len(self.all)

    def slice(self, start: int, length: int) -> np.ndarray:
        return self.all[start: start + length]


def windows(*rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose full windows are `rows` (inputs = all but the last token, targets = all but the first)."""
    t = torch.tensor(rows)
    return t[:, :-1], t[:, 1:]


def ctx_of(loader: Loader, vocab: int = 10, bs: int = 2, val: list | None = None, decode: object = None) -> SimpleNamespace:
    tok = SimpleNamespace(decode=decode or (lambda ids: " ".join(map(str, ids))))
    return SimpleNamespace(model_cfg=SimpleNamespace(vocab_size=vocab), cfg=SimpleNamespace(batch_size=bs, eval_batches=1),
                           batches=SimpleNamespace(train=loader, val=val, tokenizer=tok))


# ------------------------------------------------------------------------------------ helpers
def test_draw_batches_reads_ahead_without_consuming() -> None:
    loader = Loader([windows([1, 2, 3]), windows([4, 5, 6]), windows([7, 8, 9])])
    got = D.draw_batches(loader, 5, 2)
    assert [b[0].tolist() for b in got] == [[[1, 2]], [[4, 5]]] and loader.asked == [5, 5] and loader.pos == 0


def test_rows_are_the_full_windows() -> None:
    assert [r.tolist() for r in D._rows([windows([1, 2, 3], [4, 5, 6]), windows([7, 8, 9])])] == [
        [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert all(r.dtype == np.int64 for r in D._rows([windows([1, 2])]))


def test_ngram_hash_is_a_sum_of_token_times_odd_coefficient() -> None:
    c = D._coefficients(3)
    assert len(c) == 3 and c.dtype == np.uint64 and all(int(x) % 2 == 1 for x in c)
    assert np.array_equal(c, D._coefficients(3))  # fixed: the gate is deterministic
    assert len(set(D._coefficients(32).tolist())) == 32
    # one-hot spans give the coefficients themselves; the hash is linear mod 2^64
    assert D.ngram_hashes(np.array([1, 0, 0]), 3).tolist() == [int(c[0])]
    assert D.ngram_hashes(np.array([0, 0, 1]), 3).tolist() == [int(c[2])]
    assert D.ngram_hashes(np.array([5, 7, 9]), 3).tolist() == [(5 * int(c[0]) + 7 * int(c[1]) + 9 * int(c[2])) % 2**64]


def test_ngram_hashes_of_every_span() -> None:
    h = D.ngram_hashes(np.array([1, 2, 1, 2, 3]), 2)  # spans 12 21 12 23
    assert len(h) == 4 and h[0] == h[2] and len({int(x) for x in h}) == 3
    assert len(D.ngram_hashes(np.array([1, 2, 3]), 3)) == 1  # exactly one span
    assert len(D.ngram_hashes(np.array([1, 2]), 3)) == 0 and D.ngram_hashes(np.array([1, 2]), 3).dtype == np.uint64
    assert len(D.ngram_hashes(np.arange(40))) == 40 - 32 + 1  # NGRAM = 32 by default
    assert D.NGRAM == 32


def test_chunks_cover_everything_within_the_budget_else_spread_evenly() -> None:
    assert D._chunks(10, 10, 4, 1) == [(0, 5), (4, 5), (8, 2)]  # at the budget: everything, chunks overlap by 1
    assert D._chunks(8, 10, 4, 0) == [(0, 4), (4, 4)]
    assert D._chunks(11, 10, 4, 1) == [(0, 5), (6, 5)]  # past it: 10 // 4 = 2 chunks, from 0 to 11 - 5
    assert D._chunks(100, 12, 4, 0) == [(0, 4), (48, 4), (96, 4)]  # 12 // 4 = 3 chunks
    assert D._chunks(100, 3, 4, 0) == [(0, 4)]  # a budget under one chunk still scans one


# ------------------------------------------------------------------------------------ token_range
def test_token_range_scans_every_shard_and_names_where_the_maximum_is() -> None:
    loader = Loader([], Stream([1, 2, 3], [9, 0], [4]))
    r = D.token_range(ctx_of(loader, vocab=10), [np.array([5, 6])])
    assert (r.name, r.passed, r.value, r.threshold) == ("data.token_range", True, 9.0, "< 10")  # vocab - 1: inside
    assert r.detail == "max token id 9 (in shard_1.bin), vocabulary 10; scanned 6 of 6 training tokens + 1 validation windows"
    r = D.token_range(ctx_of(loader, vocab=9), [])  # an id equal to the vocabulary size is outside it
    assert not r.passed and r.detail == ("token id 9 is outside the vocabulary (data tokenized with another tokenizer?); "
                                         "max token id 9 (in shard_1.bin), vocabulary 9; scanned 6 of 6 training "
                                         "tokens + 0 validation windows")


def test_token_range_validation_windows_and_ties() -> None:
    loader = Loader([], Stream([3, 7], [7, 1]))
    r = D.token_range(ctx_of(loader, vocab=20), [np.array([], dtype=np.int64), np.array([12, 2]), np.array([12])])
    assert r.value == 12.0 and "(in validation windows)" in r.detail and "+ 3 validation windows" in r.detail
    r = D.token_range(ctx_of(loader, vocab=20), [np.array([7])])  # a tie keeps the first place it was seen
    assert "(in shard_0.bin)" in r.detail


def test_token_range_scans_evenly_spaced_chunks_beyond_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "SCAN_CHUNK", 2)
    monkeypatch.setattr(D, "RANGE_SCAN_TOKENS", 8)  # two shards: 4 tokens each, in chunks of 2
    a, b = list(range(10)), [0] * 6 + [50]
    r = D.token_range(ctx_of(Loader([], Stream(a, b)), vocab=100), [])
    # shard a: chunks at 0 and 8 (tokens 0,1 and 8,9); shard b: at 0 and 5 (0,0 and 0,50)
    assert r.value == 50.0 and "scanned 8 of 17 training tokens" in r.detail and "(in shard_1.bin)" in r.detail


def test_token_range_one_shard_gets_the_whole_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "SCAN_CHUNK", 2)
    monkeypatch.setattr(D, "RANGE_SCAN_TOKENS", 8)
    r = D.token_range(ctx_of(Loader([], Stream([0] * 10)), vocab=5), [])  # 4 chunks of 2 tokens
    assert r.value == 0.0 and "scanned 8 of 10 training tokens" in r.detail  # an all-zero stream: max id 0


def test_token_range_without_a_stream_samples_the_loaders_batches() -> None:
    loader = Loader([windows([1, 2, 3], [4, 11, 6])])
    r = D.token_range(ctx_of(loader, vocab=11), [])
    assert not r.passed and r.value == 11.0 and "(in training batches)" in r.detail
    assert f"scanned {6 * D.MAX_SAMPLE_BATCHES:,} sampled training tokens" in r.detail
    assert loader.asked == [2] * D.MAX_SAMPLE_BATCHES and loader.pos == 0


# ------------------------------------------------------------------------------------ no_repeats
def test_no_repeats_names_repeated_windows_by_position() -> None:
    loader = Loader([windows([1, 2, 3], [4, 5, 6]), windows([1, 2, 3], [7, 8, 9]), windows([4, 5, 6], [1, 2, 3])])
    r = D.no_repeats(ctx_of(loader, bs=2), k=5)  # windows #0..#4: 123 456 123 789 456
    assert (r.name, r.passed, r.value, r.threshold) == ("data.no_repeats", False, 2.0, "0 repeated windows")
    assert r.detail == ("the loader repeats windows (#2 = #0, #4 = #1); 2 repeats among the first 5 training "
                        "windows the loader yields")
    assert loader.asked == [2, 2, 2] and loader.pos == 0  # ceil(5 / 2) batches, not consumed
    loader.asked.clear()
    r = D.no_repeats(ctx_of(loader, bs=2), k=2)
    assert loader.asked == [2]  # one batch holds both windows
    assert r.passed and r.value == 0.0 and r.detail == "0 repeats among the first 2 training windows the loader yields"
    assert D.no_repeats(ctx_of(loader, bs=2), k=3).value == 1.0
    assert D.no_repeats(ctx_of(Loader([windows([1, 2])]), bs=4), k=0).detail.endswith("first 0 training windows "
                                                                                       "the loader yields")


def test_no_repeats_shows_at_most_five() -> None:
    loader = Loader([windows(*[[1, 2]] * 8)])
    r = D.no_repeats(ctx_of(loader, bs=8), k=8)
    assert r.value == 7.0 and "(#1 = #0, #2 = #0, #3 = #0, #4 = #0, #5 = #0); 7 repeats" in r.detail


# ------------------------------------------------------------------------------------ train/val
def test_no_validation_split_has_nothing_to_compare() -> None:
    r = D.train_val_disjoint(ctx_of(Loader([])), [])
    assert (r.name, r.passed, r.value, r.threshold, r.detail) == (
        "data.train_val_disjoint", True, 0.0, "<= 2%", "no validation split: nothing to compare")


def test_a_validation_window_copied_from_training_is_found() -> None:
    train = Stream([1, 2, 3, 4, 5, 6], [7, 8])
    val = [np.array([9, 3, 4, 5, 9]), np.array([9, 9, 9, 9]), np.array([6, 7, 8])]  # 345 in one shard; 678 spans both
    r = D.train_val_disjoint(ctx_of(Loader([], train)), val, n=3, max_overlap=2 / 3)
    assert (r.name, r.passed, r.value) == ("data.train_val_disjoint", True, 2 / 3)  # exactly at the limit: passes
    assert r.threshold == "<= 67% of validation windows"
    assert r.detail == "2 of 3 validation windows share a 3-token span with training (scanned all 8 training tokens); e.g. '3 4 5'"
    r = D.train_val_disjoint(ctx_of(Loader([], train)), val, n=3, max_overlap=0.5)
    assert not r.passed and r.detail.startswith("validation text also appears in training (validation loss would "
                                                "be optimistic); 2 of 3")
    clean = D.train_val_disjoint(ctx_of(Loader([], train)), [np.array([9, 9, 9])], n=3)
    assert clean.passed and clean.value == 0.0 and clean.detail.endswith("(scanned all 8 training tokens)")
    short = D.train_val_disjoint(ctx_of(Loader([], train)), [np.array([3, 4])], n=3)  # shorter than a span
    assert short.passed and short.value == 0.0


def test_example_span_is_cut_at_eighty_characters() -> None:
    train = Stream([1, 2, 3])
    r = D.train_val_disjoint(ctx_of(Loader([], train), decode=lambda ids: "x" * 81), [np.array([1, 2, 3])], n=3)
    assert r.detail.endswith("e.g. '" + "x" * 80 + "…'")
    r = D.train_val_disjoint(ctx_of(Loader([], train), decode=lambda ids: "y" * 80), [np.array([1, 2, 3])], n=3)
    assert r.detail.endswith("e.g. '" + "y" * 80 + "'")
    # the first shared span of the row, not its first span
    r = D.train_val_disjoint(ctx_of(Loader([], Stream([5, 6, 7]))), [np.array([0, 5, 6, 7, 5, 6, 7])], n=3)
    assert r.detail.endswith("e.g. '5 6 7'")


def test_train_val_disjoint_scans_evenly_spaced_chunks_of_a_long_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "SCAN_CHUNK", 4)
    monkeypatch.setattr(D, "TRAIN_SCAN_TOKENS", 8)
    train = Stream(list(range(20)))  # 2 chunks of 4 (+2 overlap) from 0 and 14: tokens 0-5 and 14-19
    r = D.train_val_disjoint(ctx_of(Loader([], train)), [np.array([2, 3, 4]), np.array([8, 9, 10])], n=3)
    assert r.value == 0.5 and "(scanned 8 of 20 training tokens, evenly spaced)" in r.detail


def test_train_val_disjoint_scans_everything_at_exactly_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "SCAN_CHUNK", 4)
    monkeypatch.setattr(D, "TRAIN_SCAN_TOKENS", 8)
    r = D.train_val_disjoint(ctx_of(Loader([], Stream(list(range(8))))), [np.array([9, 9, 9])], n=3)
    assert r.detail.endswith("(scanned all 8 training tokens)")


def test_train_val_disjoint_without_a_stream_samples_batches() -> None:
    loader = Loader([windows([1, 2, 3, 4])])
    r = D.train_val_disjoint(ctx_of(loader), [np.array([2, 3, 4]), np.array([4, 3, 2])], n=3, max_overlap=0.5)
    assert r.passed and r.value == 0.5
    assert f"(scanned {D.MAX_SAMPLE_BATCHES} sampled training windows)" in r.detail and loader.pos == 0
    assert loader.asked == [2] * D.MAX_SAMPLE_BATCHES  # the run's micro-batch size


def test_data_gates_run_all_three_or_the_loaders_own() -> None:
    loader = Loader([windows([1, 2, 3], [4, 5, 6])], Stream([1, 2, 3, 4, 5, 6]))
    val = lambda n: [windows([1, 2, 3])] * n  # noqa: E731
    got = D.data_gates(ctx_of(loader, val=val), k=2)
    assert [g.name for g in got] == ["data.token_range", "data.no_repeats", "data.train_val_disjoint"]
    assert "+ 1 validation windows" in got[0].detail and "first 2 training windows" in got[1].detail
    assert got[2].detail.startswith("0 of 1 validation windows")  # 123 is shorter than a 32-token span
    assert "+ 0 validation windows" in D.data_gates(ctx_of(loader, val=None))[0].detail
    assert "first 64 training windows" in D.data_gates(ctx_of(loader))[1].detail
    ctx = ctx_of(loader)
    loader.data_gates = lambda c: ["own"] if c is ctx else []
    assert D.data_gates(ctx) == ["own"]


# ------------------------------------------------------------------------------------ tokenizer
class Tok:
    bos_id, eos_id, pad_id, sha256 = 1, 2, 0, "tok"

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def tok_ctx(report: dict | None, val: object = None, train: Loader | None = None) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(batch_size=2, eval_batches=1),
                           batches=SimpleNamespace(train=train or Loader([windows([3, 4, 2, 5])]), val=val,
                                                   tokenizer=Tok(), data_report=report))


@pytest.fixture
def fert(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Stand-ins for training.text.fertility: record what reaches the measurement and the gates."""
    calls: list[tuple] = []

    def gates(report: dict, **kw: object) -> list:
        calls.append(("gates", report, kw))
        if report.get("broken"):
            raise KeyError("languages")
        return [D.GateResult("tokenizer.fertility", report.get("ok", True), detail="d"),
                D.GateResult("tokenizer.balance", False, detail="b")]

    monkeypatch.setattr(D, "fertility_gates", gates)
    monkeypatch.setattr(D, "fertility_report",
                        lambda tok, docs: calls.append(("measure", docs)) or {"measured": isinstance(tok, Tok)})
    return calls


def test_tokenizer_gates_recompute_from_the_data_report(fert: list[tuple]) -> None:
    rep = {"fertility": {"tokenizer_sha256": "tok", "total": {"n_docs": 7}},
           "gate_options": {"fertility_floor": 2.5, "fertility_ratio": 0.8, "balance_range": [0.5, 2.0],
                            "skip_gates": ["tokenizer.balance"]}}
    got = D.tokenizer_gates(tok_ctx(rep))
    assert fert == [("gates", rep["fertility"], {"floor": 2.5, "ratio": 0.8, "balance_range": (0.5, 2.0)})]
    assert got[0].detail == "d [data report (7 held-out documents)]"
    assert got[1].detail == ("failed at prepare time too, where it was skipped with --skip-gate; skip it here as well "
                             "to train anyway: b [data report (7 held-out documents)]")


def test_tokenizer_gates_defaults_and_a_report_without_a_tokenizer_hash(fert: list[tuple]) -> None:
    got = D.tokenizer_gates(tok_ctx({"fertility": {}, "gate_options": "damaged"}))
    assert fert[0][2] == {"balance_range": D.DEFAULT_BALANCE_RANGE} and got[1].detail == "b [data report (? held-out documents)]"


@pytest.mark.parametrize(("report", "why"), [
    (None, "no fertility report"),
    ({"fertility": {"tokenizer_sha256": "other"}}, "the report describes another tokenizer"),
    ({"fertility": {"tokenizer_sha256": "tok", "broken": True}}, "a malformed fertility section"),
])
def test_tokenizer_gates_measure_decoded_validation_text_otherwise(fert: list[tuple], report: dict | None,
                                                                   why: str) -> None:
    # validation windows 1 3 4 2 5 6 | 7 0 8: documents cut at <s> (1), </s> (2) and padding (0)
    val = lambda n: [windows([1, 3, 4, 2, 5, 6]), windows([7, 0, 8])]  # noqa: E731
    got = D.tokenizer_gates(tok_ctx(report, val=val))
    assert ("measure", ["de", "fg", "h", "i"]) in fert
    assert fert[-1] == ("gates", {"measured": True}, {"balance_range": D.DEFAULT_BALANCE_RANGE})  # the run's tokenizer
    assert got[0].detail == f"d [measured on 4 decoded validation documents ({why} in the data folder)]"
    assert got[1].detail == f"b [measured on 4 decoded validation documents ({why} in the data folder)]"


def test_tokenizer_gates_with_no_text_gate_nothing(fert: list[tuple]) -> None:
    empty = Loader([windows([1, 2])])  # only <s> and </s>: no document
    got = D.tokenizer_gates(tok_ctx(None, train=empty))
    assert [(g.name, g.passed, g.detail) for g in got] == [
        ("tokenizer", True, "no fertility report and no text to measure: nothing to gate")]


def test_decoded_docs_fall_back_to_training_windows_and_stop_at_the_budget() -> None:
    train = Loader([windows([3, 4, 2, 5]), windows([6, 7, 8, 9])])
    assert D._decoded_docs(tok_ctx(None, train=train))[:3] == ["de", "f", "ghij"]
    assert train.asked == [2] * D.MAX_SAMPLE_BATCHES and train.pos == 0
    assert D._decoded_docs(tok_ctx(None, train=train), budget=4) == ["de", "f"]  # one window of 4 tokens
    assert D._decoded_docs(tok_ctx(None, train=train), budget=5) == ["de", "f", "ghij"]
    assert len(D._decoded_docs(tok_ctx(None, train=train))) == D.MAX_SAMPLE_BATCHES // 2 * 3  # 2 + 1 docs per pair

"""serving/text_stream.py in-process (issue #46 item 3, mutation target `text-stream`), on a scripted
backend whose tokens are byte strings. What the module promises (its docstring, docs/serving.md):
incomplete UTF-8 is held back until it completes, a sequence that never becomes UTF-8 is dropped and
counted, so no U+FFFD is ever shown; stop strings end the reply and are never shown, not even in part;
`cancel()` ends a stream at its next token ("cancelled"), as does a consumer closing it; the budget or
the context running out is "length", the backend ending by itself "stop". test_stream_text.py checks
the same on a real model through every runtime (it trains and exports: minutes per mutant).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from serving.backend import SamplingParams
from serving.text_stream import (
    RECENT_STATS,
    GenerationProbe,
    GenerationStats,
    ModelTurns,
    OwnTurn,
    TextStream,
    _held_tail,
    bytes_decoder,
    text_decoder,
)
from training.text.wellformed import REPLACEMENT

BN = "আম"  # two Bengali letters, 3 UTF-8 bytes each
B = BN.encode()


class Scripted:
    """A backend that emits `script` (token id -> bytes through `pieces`) and records how it was used."""

    name = "scripted"
    eos_ids = (0,)

    def __init__(self, pieces: dict[int, bytes], script: Sequence[int], n_ctx: int = 1000,
                 on_token=None, fail_at: int | None = None) -> None:
        self.pieces, self.script, self.n_ctx, self.on_token = pieces, list(script), n_ctx, on_token
        self.closed = False
        self.yielded = 0
        self.prompts: list[list[int]] = []
        self.fail_at = fail_at

    def detokenize_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.pieces[i] for i in ids)

    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        self.prompts.append(list(ids))
        return Tokens(self, self.script[:params.max_new_tokens])


class Tokens:
    """The backend's token iterator with a close() of its own (llama.cpp releases its context lock there):
    not a generator, so nothing but an explicit close() closes it."""

    def __init__(self, backend: Scripted, ids: list[int]) -> None:
        self.backend, self.ids = backend, iter(ids)

    def __iter__(self) -> Tokens:
        return self

    def __next__(self) -> int:
        t = next(self.ids)
        b = self.backend
        b.yielded += 1
        if b.fail_at == b.yielded:
            raise RuntimeError("backend died")
        if b.on_token:
            b.on_token(b.yielded)
        return t

    def close(self) -> None:
        self.backend.closed = True


def pieces_of(*parts: bytes) -> tuple[dict[int, bytes], list[int]]:
    return {i + 1: p for i, p in enumerate(parts)}, list(range(1, len(parts) + 1))


def stream(*parts: bytes, stop: Sequence[str] = (), max_new: int = 100, prompt: int = 3, n_ctx: int = 1000,
           **kw) -> tuple[TextStream, Scripted]:
    pieces, script = pieces_of(*parts)
    backend = Scripted(pieces, script, n_ctx=n_ctx)
    return TextStream(backend, list(range(prompt)), SamplingParams(max_new_tokens=max_new, stop=tuple(stop)), **kw), backend


# --------------------------------------------------------------------------- ids -> bytes -> text
def test_bytes_decoder_prefers_the_backends_bytes_then_the_tokenizers_then_text():
    class Own:
        def detokenize_bytes(self, ids):
            return b"own"

        def detokenize(self, ids):
            return "text"

    class Tok:
        def decode_bytes(self, ids):
            return b"tok"

    class WithTokenizer:
        tokenizer = Tok()

        def detokenize(self, ids):
            return "text"

    class TextOnly:
        def detokenize(self, ids):
            return "".join(BN[i] for i in ids)

    class TokenizerWithoutBytes:
        tokenizer = object()  # a tokenizer that cannot give bytes: the text it is

        def detokenize(self, ids):
            return "".join(BN[i] for i in ids)

    assert bytes_decoder(Own())([1]) == b"own"
    assert bytes_decoder(WithTokenizer())([1]) == b"tok"
    assert bytes_decoder(TextOnly())([1, 0]) == "মআ".encode()  # the text of those ids as UTF-8
    assert bytes_decoder(TokenizerWithoutBytes())([0]) == "আ".encode()


def test_bytes_decoder_is_cached_per_backend_and_works_where_it_cannot_be():
    class TextOnly:
        def __init__(self, text: str) -> None:
            self.text = text

        def detokenize(self, ids):
            return self.text

    a = TextOnly("a")
    first = bytes_decoder(a)
    assert bytes_decoder(a) is first and a._prodip_bytes_decoder is first
    a.text = "b"  # the cached decoder still reads the backend live
    assert first([1]) == b"b"

    class Slotted:
        __slots__ = ()

        def detokenize(self, ids):
            return "s"

    assert bytes_decoder(Slotted())([1]) == b"s"  # no attribute to cache in: decoded all the same


def test_text_decoder_drops_invalid_bytes_instead_of_showing_replacement():
    class Raw:
        def detokenize_bytes(self, ids):
            return b"a\xffb" * len(ids) + B + b"\xe0"  # 0xFF never valid, a lone lead byte at the end

    assert text_decoder(Raw())([1, 2]) == "abab" + BN


# --------------------------------------------------------------------------- stats and the probe
def test_tokens_per_second_after_the_first_token():
    s = GenerationStats(prompt_tokens=1, completion_tokens=5, time_to_first_token_s=1.0, total_s=3.0)
    assert s.tokens_per_s == 2.0  # 4 tokens after the first, in 2 s
    assert GenerationStats(1, 2, 1.0, 1.5).tokens_per_s == 2.0  # the second token alone: 1 in 0.5 s
    assert GenerationStats(1, 1, 1.0, 3.0).tokens_per_s is None  # only the first: it paid for the prompt
    assert GenerationStats(1, 5, None, 3.0).tokens_per_s is None  # no token yet
    assert GenerationStats(1, 5, 3.0, 3.0).tokens_per_s is None  # no time after the first


def test_the_probe_counts_waiting_running_refused_and_keeps_recent_bounded():
    p = GenerationProbe()
    assert p.snapshot() == {"waiting": 0, "active": 0, "peak_waiting": 0, "peak_active": 0, "started": 0,
                            "finished": 0, "refused": 0}
    p.wait_begin()
    p.wait_begin()
    p.wait_end()
    with p.queued():
        assert p.snapshot()["waiting"] == 2
    p.refuse()
    p.refuse()
    stats = [GenerationStats(prompt_tokens=i) for i in range(RECENT_STATS + 1)]
    with p.running(stats[0]), p.running(stats[1]):
        assert p.snapshot()["active"] == 2
    for s in stats[2:]:
        with p.running(s):
            pass
    assert p.snapshot() == {"waiting": 1, "active": 0, "peak_waiting": 2, "peak_active": 2,
                            "started": RECENT_STATS + 1, "finished": RECENT_STATS + 1, "refused": 2}
    assert list(p.recent) == [stats[1], stats[0], *stats[2:]][-RECENT_STATS:]  # the newest, bounded


def test_a_failed_generation_still_ends_its_turn():
    p = GenerationProbe()
    with pytest.raises(RuntimeError), p.running(GenerationStats(1)):
        raise RuntimeError("backend died")
    with pytest.raises(RuntimeError), p.queued():
        raise RuntimeError("gave up waiting")
    snap = p.snapshot()
    assert (snap["active"], snap["finished"], snap["waiting"], len(p.recent)) == (0, 1, 0, 1)


# --------------------------------------------------------------------------- stop strings held back
@pytest.mark.parametrize(("text", "stops", "held"), [
    ("abc ST", ["STOP"], 2), ("abc STO", ["STOP"], 3), ("abc", ["STOP"], 0), ("ST", ["STOP"], 2),
    ("abcSTOP", ["STOP"], 0),  # a whole stop string is found, not held: only proper prefixes are
    ("xa", ["ab", "STOP"], 1), ("a S", ["ab", "SX"], 1), ("ab", ["b!", "ab!"], 2), ("", ["ab"], 0),
    ("abS", ["S"], 0),  # a one-character stop has no proper prefix
])
def test_held_tail_is_the_longest_suffix_that_may_still_become_a_stop(text, stops, held):
    assert _held_tail(text, stops) == held


# --------------------------------------------------------------------------- the stream
def test_a_reply_streams_whole_characters_and_ends_with_stop():
    s, backend = stream(b"hi ", B[:2], B[2:4], B[4:])  # আ split 2+1 across tokens, ম split 2+1
    pieces = list(s)
    assert pieces == ["hi ", "আ", "ম"] and s.text == "hi " + BN
    assert s.stats.finish_reason == "stop" and s.stats.completion_tokens == 4 and s.stats.prompt_tokens == 3
    assert s.stats.invalid_bytes == 0 and backend.closed


def test_invalid_bytes_are_dropped_and_counted_and_an_unfinished_end_too():
    s, _ = stream(b"a", b"\xff", b"b", B[:2])  # 0xFF: never valid; the last character never completes
    assert "".join(s) == "ab" and REPLACEMENT not in s.text
    assert s.stats.invalid_bytes == 2 and s.text == "ab"
    mid, _ = stream(b"a", b"\xff", b"b", b"\xfe", b"c", max_new=100)
    assert list(mid) == ["a", "b", "c"] and mid.stats.invalid_bytes == 2


def test_the_budget_or_the_context_running_out_is_length():
    s, _ = stream(b"a", b"b", b"c", max_new=3)
    assert "".join(s) == "abc" and s.stats.finish_reason == "length"
    under, _ = stream(b"a", b"b", b"c", max_new=4)
    assert "".join(under) == "abc" and under.stats.finish_reason == "stop"
    ctx, _ = stream(b"a", b"b", prompt=3, n_ctx=5)  # 3 + 2 tokens fill a 5-token context
    assert "".join(ctx) == "ab" and ctx.stats.finish_reason == "length"
    room, _ = stream(b"a", b"b", prompt=3, n_ctx=6)
    assert "".join(room) == "ab" and room.stats.finish_reason == "stop"


def test_a_stop_string_ends_the_reply_and_is_never_shown_even_in_part():
    s, backend = stream(b"one ", b"tw", b"o S", b"T", b"OP three", b" four", stop=["STOP"])
    pieces = list(s)
    assert "".join(pieces) == "one two " and s.text == "one two "
    assert all("S" not in p for p in pieces)  # "S" and "ST" were held back, never shown
    assert s.stats.finish_reason == "stop" and backend.yielded == 5 and backend.closed


def test_a_held_prefix_that_is_no_stop_is_shown_once_it_is_not():
    s, _ = stream(b"a ST", b"x", b"!", stop=["STOP"])
    assert list(s) == ["a ", "STx", "!"] and s.stats.finish_reason == "stop" and s.text == "a STx!"


def test_the_earliest_of_several_stop_strings_wins_and_empty_ones_are_ignored():
    s, _ = stream(b"x<end> y ## z", stop=["", "##", "<end>"])
    assert list(s) == ["x"] and s.text == "x"
    at_start, _ = stream(b"##tail", stop=["##"])
    assert list(at_start) == [] and at_start.text == "" and at_start.stats.finish_reason == "stop"
    after, _ = stream(b"ab", b"c##", stop=["##"])  # found after text already shown
    assert list(after) == ["ab", "c"] and after.text == "abc"


def test_cancel_ends_the_stream_at_its_next_token():
    s, backend = stream(b"a", b"b", b"c", b"d")
    it = iter(s)
    assert next(it) == "a"
    s.cancel()
    assert list(it) == []
    assert s.stats.finish_reason == "cancelled" and s.text == "a" and backend.yielded == 2 and backend.closed
    assert s.stats.completion_tokens == 1


def test_a_consumer_closing_the_stream_cancels_the_generation():
    s, backend = stream(b"a", b"b", b"c")
    it = iter(s)
    assert next(it) == "a"
    it.close()
    assert s.stats.finish_reason == "cancelled" and backend.closed and backend.yielded == 1


class Arrived:
    """A server's turn: it came at once, for a request that arrived at `at` (serving.server.scheduler.Job's)."""

    def __init__(self, at: float) -> None:
        self.at = at

    @contextlib.contextmanager
    def hold(self, stats: GenerationStats):
        stats.queued_at, stats.started_at = self.at, time.perf_counter()
        yield


def test_timing_is_recorded_in_order():
    s, _ = stream(b"a", b"b", turn=Arrived(1.0))  # the request's arrival comes with its turn: kept
    list(s)
    st = s.stats
    assert st.queued_at == 1.0 and st.started_at is not None and st.ended_at is not None
    assert 1.0 < st.started_at <= st.ended_at
    assert 0.0 <= st.time_to_first_token_s <= st.total_s <= st.ended_at - st.started_at
    fresh, _ = stream(b"a")
    list(fresh)
    assert fresh.stats.queued_at is not None and fresh.stats.queued_at <= fresh.stats.started_at
    none, _ = stream(max_new=5)  # no token at all
    assert list(none) == [] and none.stats.time_to_first_token_s is None
    assert none.stats.finish_reason == "stop" and none.stats.completion_tokens == 0


def test_the_models_turn_is_held_for_the_whole_generation_and_its_probe_counts_it():
    turns, seen = ModelTurns(), []
    pieces, script = pieces_of(b"a", b"b")
    backend = Scripted(pieces, script, on_token=lambda n: seen.append((turns.locked(), turns.probe.snapshot()["active"])))
    s = TextStream(backend, [1], SamplingParams(max_new_tokens=10), turns)
    assert not turns.locked()  # made, not started: the turn is taken when the generation starts
    assert "".join(s) == "ab" and not turns.locked()
    assert seen == [(True, 1), (True, 1)]
    snap = turns.probe.snapshot()
    assert (snap["peak_waiting"], snap["waiting"], snap["finished"], snap["active"]) == (1, 0, 1, 0)
    assert list(turns.probe.recent) == [s.stats]
    assert s.stats.queued_at <= s.stats.started_at
    own = OwnTurn()
    list(stream(b"a", turn=own)[0])
    assert own.probe.snapshot()["peak_waiting"] == 0 and own.probe.snapshot()["finished"] == 1


def test_a_second_generation_waits_for_the_models_turn():
    # one generation at a time per model: a stream started while another holds the turn waits (counted)
    turns, order = ModelTurns(), []
    first, _ = stream(b"a", b"b", turn=turns)
    it = iter(first)
    assert next(it) == "a" and turns.locked()
    second, _ = stream(b"c", turn=turns)
    t = threading.Thread(target=lambda: order.append("".join(second)))
    t.start()
    deadline = time.monotonic() + 10
    while turns.probe.snapshot()["waiting"] != 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert turns.probe.snapshot()["waiting"] == 1 and order == []  # it waits while the first holds the turn
    assert "".join(it) == "b"
    t.join(10)
    assert order == ["c"] and turns.probe.snapshot()["finished"] == 2 and not turns.locked()


def test_the_turn_is_released_when_the_consumer_stops_early():
    turns = ModelTurns()
    s, _ = stream(b"a", b"b", turn=turns)
    it = iter(s)
    next(it)
    assert turns.locked()
    it.close()
    assert not turns.locked()
    assert turns.probe.snapshot()["finished"] == 1


def test_the_backend_is_asked_for_the_prompts_ids_and_closed_when_the_stream_ends():
    s, backend = stream(b"a", b"b", prompt=4)
    assert "".join(s) == "ab" and backend.prompts == [[0, 1, 2, 3]] and backend.closed
    plain = Scripted({1: b"x"}, [1])
    plain.generate = lambda ids, params: iter([1])  # an iterator without close(): fine
    assert "".join(TextStream(plain, [0], SamplingParams(max_new_tokens=5))) == "x"


def test_a_stop_string_found_twice_ends_at_its_first():
    s, _ = stream(b"x##y##z", stop=["##"])
    assert list(s) == ["x"] and s.text == "x"


def test_cancelled_before_the_first_token():
    s, backend = stream(b"a", b"b")
    s.cancel()
    assert list(s) == [] and s.text == "" and s.stats.finish_reason == "cancelled" and backend.closed
    assert s.stats.time_to_first_token_s is None and s.stats.completion_tokens == 0


def test_a_backend_failing_mid_stream_leaves_no_finish_reason():
    pieces, script = pieces_of(b"a", b"b", b"c")
    backend = Scripted(pieces, script, fail_at=2)
    s = TextStream(backend, [0], SamplingParams(max_new_tokens=10))
    it = iter(s)
    assert next(it) == "a"
    with pytest.raises(RuntimeError, match="backend died"):
        next(it)
    assert s.stats.finish_reason is None and s.text == "a" and backend.closed and s.stats.ended_at is not None


def test_stats_are_live_while_the_reply_streams():
    # what the reader sees between tokens: the time so far (tokens/s shown mid-reply), no byte yet
    # counted invalid while a character is still incomplete, and the first token's time set once
    pieces, script = pieces_of(b"a", B[:2], B[2:3], b"b")
    backend = Scripted(pieces, script)
    s = TextStream(backend, [0], SamplingParams(max_new_tokens=10))
    seen = []
    backend.on_token = lambda n: seen.append((n, s.stats.completion_tokens, s.stats.invalid_bytes,
                                              s.stats.time_to_first_token_s, s.stats.total_s, time.perf_counter()))
    assert "".join(s) == "aআb" and s.stats.invalid_bytes == 0
    first = seen[1][3]
    for n, done, invalid, ttft, total, now in seen[1:]:
        assert done == n - 1 and invalid == 0 and ttft == first
        assert ttft <= total <= now - s.stats.started_at
    one, _ = stream(b"a")
    list(one)
    assert one.stats.time_to_first_token_s is not None

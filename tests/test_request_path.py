"""One request path (issue #43 item 3): sampling settings are checked once, where they enter (an HTTP
body, the CLI's flags, the demo's widgets), into a frozen SamplingParams that cannot be made invalid and
that every later layer trusts; one GenerationRequest carries a generation from its entry; one owner per
program decides whose turn it is, and gives each stream its turn when the stream is made. The ranges are
serving's documented ones (docs/serving.md, `python -m serving --help`): max tokens in [1, 65536],
temperature in [0, 10], top-k in [0, 2^20], top-p in (0, 1], repetition penalty in (0, 10], seed in
[0, 2^63); strict types (a "0.5" is no number, true no count).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Iterator, Sequence

import pytest

import serving.backend
from serving.__main__ import build_parser, sampling
from serving.backend import SamplingParams, ServingError
from serving.chat_session import GenerationRequest, open_stream
from serving.server.http_requests import request_from_body
from serving.server.scheduler import Scheduler

BAD = [("max_new_tokens", 0), ("max_new_tokens", 65537), ("max_new_tokens", 2.0), ("max_new_tokens", True),
       ("temperature", -0.1), ("temperature", 10.5), ("temperature", float("nan")), ("temperature", "0.5"),
       ("top_k", -1), ("top_k", (1 << 20) + 1), ("top_k", 1.5), ("top_p", 0.0), ("top_p", 1.01),
       ("repetition_penalty", 0.0), ("repetition_penalty", 10.5), ("seed", -1), ("seed", 1 << 63),
       ("stop", "##"), ("stop", ("a", 5)), ("stop", 5)]
EDGES = {"max_new_tokens": (1, 65536), "temperature": (0.0, 10.0), "top_k": (0, 1 << 20), "top_p": (1e-9, 1.0),
         "repetition_penalty": (1e-9, 10.0), "seed": (0, (1 << 63) - 1)}


@pytest.mark.parametrize(("name", "value"), BAD)
def test_a_sampling_params_cannot_be_made_with_a_value_out_of_range(name, value):
    with pytest.raises(ServingError, match=f"^{name} = "):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", EDGES)
def test_each_range_includes_its_edges(name):
    for v in EDGES[name]:
        assert getattr(SamplingParams(**{name: v}), name) == v


def test_a_sampling_params_is_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 99.0  # type: ignore[misc]
    assert SamplingParams(stop=["a"]).stop == ("a",)  # a list is kept as a tuple: nothing mutable inside


def test_from_user_keeps_defaults_for_settings_not_given_and_names_the_users_spelling():
    assert SamplingParams.from_user(temperature=None, seed=None, top_k=3) == SamplingParams(top_k=3)
    with pytest.raises(ServingError, match=r"^--max-tokens = 0: "):
        SamplingParams.from_user({"max_new_tokens": "--max-tokens"}, max_new_tokens=0)


class Fake:
    """A backend with a byte-level tokenizer and a scripted reply (enough for a chat and a completion)."""

    name, n_ctx, eos_ids = "fake", 256, (0,)
    SPECIAL = {"<|im_start|>": 2, "<|im_end|>": 3}

    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]:
        if allow_special and text in self.SPECIAL:
            return [self.SPECIAL[text]]
        return [1] * bos + [10 + b for b in text.encode()]

    def detokenize_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(i - 10 for i in ids if i >= 10)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.detokenize_bytes(ids).decode("utf-8", "replace")

    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        return iter([10 + b for b in b"ok"][:params.max_new_tokens])


@pytest.fixture
def checks(monkeypatch) -> Counter:
    """Every schema check of a sampling value, by the name it was checked under."""
    seen: Counter = Counter()
    real = serving.backend.check

    def counting(type_, value, where, **kw):
        seen[where] += 1
        return real(type_, value, where, **kw)

    monkeypatch.setattr(serving.backend, "check", counting)
    return seen


BODY = {"max_tokens": 8, "temperature": 0.5, "top_k": 7, "top_p": 0.9, "repeat_penalty": 1.1, "seed": 3,
        "stop": ["##"]}


@pytest.mark.parametrize("chat", [True, False])
def test_an_http_requests_settings_are_checked_once_at_entry_and_never_after(checks, chat):
    body = {**BODY, **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    req = request_from_body(body, chat, cap=64, adapters=())
    assert set(checks.values()) == {1} and len(checks) == 6, checks  # each given setting once
    checks.clear()
    prepared, stream = open_stream(Fake(), req)
    assert "".join(stream) == "ok" and stream.stats.finish_reason == "stop"
    assert (prepared is not None) == chat
    assert not checks, f"checked again after the entry: {dict(checks)}"
    assert not hasattr(req.params, "validate")  # nothing downstream can check it again


def test_the_cli_and_the_demo_check_their_settings_once(checks):
    args = build_parser().parse_args(["model.gguf", "--temperature", "0.3", "--seed", "4"])
    params = sampling(args)
    assert (params.temperature, params.seed, params.max_new_tokens) == (0.3, 4, 256)
    assert set(checks.values()) == {1}, checks
    checks.clear()
    stream = open_stream(Fake(), GenerationRequest(params, prompt="hi"))[1]
    assert "".join(stream) == "ok" and not checks


def test_a_generation_request_is_a_chat_or_a_completion():
    p = SamplingParams()
    for bad in ({}, {"messages": [], "prompt": "x"}):
        with pytest.raises(ServingError, match="chat .* or a completion"):
            GenerationRequest(p, **bad)


def test_the_scheduler_gives_each_stream_its_turn_when_it_is_made():
    """The HTTP server's scheduler is the one owner: the work it runs is handed its job (the turn) and
    builds the stream with it; the stream's timings start at the request's arrival, counted by the
    scheduler's probe."""
    from serving.text_stream import TextStream

    made = []

    def work(turn):
        s = TextStream(Fake(), [1, 11], SamplingParams(max_new_tokens=4), turn)
        made.append((s, turn))
        return "payload", s

    async def main() -> tuple:
        sched = Scheduler(max_waiting=2, wait_s=30)

        async def stays() -> bool:
            return False

        job = sched.submit(work, arrived=arrived)
        payload = await sched.start(job, stays)
        text = "".join([p async for p in sched.pieces(job)])
        sched.close()
        return sched, job, payload, text

    arrived = time.perf_counter() - 1.0  # a request that arrived a second ago
    sched, job, payload, text = asyncio.run(main())
    (stream, turn), = made
    assert (payload, text, turn, stream.turn, job.stream) == ("payload", "ok", job, job, stream)
    assert stream.stats.queued_at == arrived and stream.stats.started_at >= arrived + 1.0
    snap = sched.probe.snapshot()
    assert (snap["started"], snap["finished"], snap["active"], snap["waiting"]) == (1, 1, 0, 0)
    assert list(sched.probe.recent) == [stream.stats]

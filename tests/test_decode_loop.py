"""The one decode loop (training.model.decode_loop) and the Python backends that drive it.

What the loop must do (issue 43, item 3): the prompt in one pass, then one token at a time through the
runtime's cache; each new id picked from the last position's logits; an end-of-turn id ends the stream
unyielded; at most `budget` ids; a consumer that stops reading stops the decoding. Every Python backend
(PyTorch, ONNX Runtime, transformers) generates through it, and greedy ids are the argmax of a
full-sequence recompute (no cache), the independent reference of fixtures_onnx.torch_greedy.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from fixtures_onnx import torch_greedy

from serving.backend import SamplingParams
from serving.backends import sampled_decode
from training.model.decode_loop import decode, feed

VOCAB = 8


class ScriptedStep:
    """A fake runtime: its cache is the number of positions fed so far; call n's last row is one-hot at
    script[n] (every other row one-hot at 0, so a loop reading the wrong row picks 0)."""

    def __init__(self, script: list[int]):
        self.script, self.calls = script, []

    def __call__(self, ids: list[int], start: int, cache: int | None) -> tuple[np.ndarray, int]:
        self.calls.append((list(ids), start, cache))
        block = np.zeros((len(ids), VOCAB))
        block[:, 0] = 1.0
        if ids:
            block[-1] = 0.0
            block[-1, self.script[min(len(self.calls) - 1, len(self.script) - 1)]] = 1.0
        return block, (cache or 0) + len(ids)


def argmax(row: np.ndarray) -> int:
    return int(np.argmax(row))


def test_prompt_in_one_pass_then_one_token_at_a_time_until_a_stop_id():
    step = ScriptedStep([1, 2, 3, 4, 5])
    got = list(decode(step, [5, 6, 7], budget=10, pick=argmax, stop={4}))
    assert got == [1, 2, 3]  # 4 ends the stream and is not yielded
    assert step.calls == [([5, 6, 7], 0, None), ([1], 3, 3), ([2], 4, 4), ([3], 5, 5)]


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_budget_bounds_the_new_ids_and_the_steps(budget):
    step = ScriptedStep([1, 2, 3, 4, 5])
    assert list(decode(step, [7], budget=budget, pick=argmax, stop=())) == [1, 2, 3][:budget]
    assert len(step.calls) == budget


def test_a_consumer_that_stops_reading_stops_the_decoding():
    step = ScriptedStep([1, 2, 3, 4, 5])
    stream = decode(step, [7, 7], budget=50, pick=argmax, stop=())
    assert list(itertools.islice(stream, 2)) == [1, 2]
    stream.close()  # serving's cancellation: the text stream stops iterating and closes the generator
    assert len(step.calls) == 2  # no forward pass after the last id read


@pytest.mark.parametrize(("prefix", "chunks"), [(0, [[4], [5], [6], [7]]), (1, [[4], [5], [6], [7]]),
                                                (3, [[4, 5, 6], [7]]), (9, [[4, 5, 6, 7]])])
def test_feed_passes_the_prefix_at_once_then_one_id_at_a_time(prefix, chunks):
    step = ScriptedStep([0])
    blocks = feed(step, [4, 5, 6, 7], prefix)
    assert [c[0] for c in step.calls] == chunks
    starts = list(itertools.accumulate([0] + [len(c) for c in chunks[:-1]]))
    assert [c[1] for c in step.calls] == starts and [c[2] for c in step.calls] == [None, *starts[1:]]
    assert [len(b) for b in blocks] == [len(c) for c in chunks]


@pytest.fixture(params=["torch", "onnx-fp32", "transformers"])
def python_backend(request, tiny_run, onnx_export, exported):  # noqa: F811
    from serving import load

    path = {"torch": tiny_run, "onnx-fp32": onnx_export[0], "transformers": exported / "hf"}[request.param]
    backend = load(path, backend=request.param.split("-")[0], threads=1)
    yield backend
    backend.close()


def test_every_python_backend_generates_through_the_one_loop(python_backend, torch_model, monkeypatch):
    chunks: list[list[int]] = []

    def spy(step, ids, budget, pick, stop):
        def recorded(chunk, start, cache):
            chunks.append(list(chunk))
            return step(chunk, start, cache)
        return decode(recorded, ids, budget, pick, stop)

    monkeypatch.setattr(sampled_decode, "decode", spy)
    model, ck = torch_model
    prompt = ck.tokenizer.encode("আজ সকালে", bos=True)
    python_backend.eos_ids = ()  # the tiny model may end early; all 12 tokens go through the cache
    got = list(python_backend.generate(prompt, SamplingParams.greedy(12)))
    assert got == torch_greedy(model, prompt, 12, ())
    assert chunks == [prompt, *([t] for t in got[:-1])]  # prefill once, then each new id alone

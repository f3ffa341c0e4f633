"""What the metrics score: a `LogProbProvider` (a tokenizer plus per-position log-probabilities), and
`RunnerScorer`, the one adapter that makes any runner one: the base's PyTorch `TransformerRunner` here,
every exported file's `serving.Backend` in export.evaluate (a Backend is a Runner).

The package's leaf: EvalError and the provider protocol, imported by every other module here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from training.model.logprobs import token_logprobs
from training.model.runner import Runner, logits_batch
from training.text import chat_template


class EvalError(ValueError):
    """Bad evaluation input (a file, a record, an option): one line, shown by the CLI without a traceback."""


@runtime_checkable
class LogProbProvider(Protocol):
    """What the metrics need from a model: its tokenizer and per-position log-probabilities.

    `token_logprobs(ids)` returns a float array of length len(ids) - 1 whose entry i - 1 is
    log p(ids[i] | ids[:i]) for i >= 1; len(ids) <= n_ctx. A provider may also offer
    `token_logprobs_batch(list_of_ids) -> list of arrays` plus `max_batch_tokens` (padded tokens per
    call) to score many sequences per forward pass. `RunnerScorer(runner)` is one for any runner.
    """

    name: str
    n_ctx: int
    bos_id: int

    def encode(self, text: str) -> list[int]: ...  # normalized text -> ids, without <s>/</s>

    def token_logprobs(self, ids: Sequence[int]) -> np.ndarray: ...


class RunnerScorer:
    """A `Runner` (or serving Backend) as a LogProbProvider: log p(ids[i] | ids[:i]) is the float64
    log-softmax of the runner's logits (`training.model.logprobs.token_logprobs`), the one path for every runtime, batched
    where the runner batches (`logits_batch` + `max_batch_tokens`). A runner that can answer greedily
    (`greedy(ids, n)`, TransformerRunner) makes it a `generate.Generator` too."""

    def __init__(self, runner: Runner, *, name: str | None = None, n_ctx: int | None = None):
        self.runner = runner
        self.name = name or runner.name
        self.n_ctx = int(n_ctx or runner.n_ctx)
        bos = list(runner.tokenize("", bos=True))
        if len(bos) != 1:
            raise EvalError(f"runner {runner.name}: tokenize('', bos=True) gave {bos}, expected just <s>")
        self.bos_id = int(bos[0])
        # 0: the metrics score one sequence per call (a runner without logits_batch gains nothing by groups)
        self.max_batch_tokens = int(getattr(runner, "max_batch_tokens", 0) or 0) if hasattr(runner, "logits_batch") else 0

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.runner.tokenize(text, bos=False)]

    def token_logprobs(self, ids: Sequence[int]) -> np.ndarray:
        return self.token_logprobs_batch([ids])[0]

    def token_logprobs_batch(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        rows = [[int(i) for i in s] for s in seqs]
        lengths = [len(s) for s in rows]
        if min(lengths) < 1 or max(lengths) > self.n_ctx:
            raise EvalError(f"sequence lengths must be in [1, {self.n_ctx}], got {min(lengths)}..{max(lengths)}")
        out = []
        for ids, logits in zip(rows, logits_batch(self.runner, rows)):
            logits = np.asarray(logits)
            if logits.ndim != 2 or logits.shape[0] != len(ids):
                raise EvalError(f"runner {self.name}: logits shape {logits.shape} for {len(ids)} tokens, expected (T, V)")
            out.append(token_logprobs(logits[:-1], ids[1:]))
        return out

    def prompt_ids(self, prompt: str, *, chat: bool) -> list[int]:
        """<s> + the chat-templated user turn (a chat model) or the plain text (a base model)."""
        if chat:
            return chat_template.encode(self.runner.tokenizer, [{"role": "user", "content": prompt}]).ids  # type: ignore[attr-defined]
        return [self.bos_id, *self.encode(prompt)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.runner.detokenize(ids)

    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Argmax continuation of `ids` (the runner's own greedy decoding): stops at end of turn."""
        greedy = getattr(self.runner, "greedy", None)
        if greedy is None:
            raise EvalError(f"runner {self.name} cannot answer greedily (no greedy())")
        return list(greedy(ids, max_new_tokens))

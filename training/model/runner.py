"""The one runner interface and the one PyTorch runner: what evaluation scores through and what every
serving backend is (`serving.Backend` extends `Runner` with generation).

- `Runner`: a tokenizer and next-token logits of a model, whatever runs it (PyTorch, ONNX Runtime,
  llama.cpp, transformers). `logits(ids)` is (T, V) fp32 numpy for one sequence; `logits_incremental`
  the same through the runtime's KV cache. A runner may also offer `logits_batch(seqs)` plus
  `max_batch_tokens` (padded tokens per call); `logits_batch(runner, seqs)` here is the default, one
  `logits` call per sequence.
- `TransformerRunner(model, tokenizer)`: `training.model.decoder.Transformer` as a Runner, batched
  (right-padded) and greedy through the one decode loop. serving's TorchBackend builds on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from training.model.decode_loop import decode, feed
from training.model.decoder import Transformer
from training.model.kv_decode import transformer_step

# fp32 logit elements per batched forward (16 MiB). Small on purpose: on CPU a batch that outgrows the
# cache is slower per token (tiny preset, 64 windows of 200 tokens, 1 thread: 2,048 tokens per forward
# 0.84-0.90 CPU s, 32,768 tokens 1.07-1.11 s, one window per forward 0.91 s); a large vocabulary gets
# one window (n_ctx tokens) per forward either way.
LOGIT_BUDGET = 1 << 22


class RunnerError(ValueError):
    """Bad input to a runner (no tokens, too many, an id outside the vocabulary): one line."""


@runtime_checkable
class Runner(Protocol):
    name: str  # e.g. "torch", "onnx-fp32", "llama.cpp-Q4_K_M"
    n_ctx: int
    eos_ids: tuple[int, ...]  # ids that end a turn (</s>, <|im_end|>)

    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def logits(self, ids: Sequence[int]) -> np.ndarray: ...  # (T, V) fp32, every position

    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray: ...


def logits_batch(runner: Runner, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """(T_i, V) logits of each sequence: the runner's own `logits_batch` where it has one, else one
    `logits` call per sequence."""
    batched = getattr(runner, "logits_batch", None)
    if batched is not None:
        return list(batched(seqs))
    return [np.asarray(runner.logits(s)) for s in seqs]


class TextCodec(Protocol):
    """What TransformerRunner needs of a tokenizer (training.text.tokenizer.Tokenizer is one)."""

    bos_id: int

    def encode(self, text: str, *, bos: bool = False, allow_special: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TransformerRunner:
    """A `Transformer` (put in eval mode, on its own device) and its tokenizer as a Runner.

    `logits_batch` scores many sequences in one forward (right-padded: padding is invisible to a causal
    model at the real positions); `greedy` answers through the KV cache. Bad ids raise `self.error`
    (RunnerError here; serving's TorchBackend raises its ServingError)."""

    error: type[ValueError] = RunnerError

    def __init__(self, model: Transformer, tokenizer: TextCodec, *, name: str = "torch",
                 eos_ids: tuple[int, ...] | None = None, max_batch_tokens: int | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        self.n_ctx = model.cfg.max_seq_len
        self.eos_ids = eos_ids if eos_ids is not None else (tokenizer.eos_id, tokenizer.im_end_id)  # type: ignore[attr-defined]
        self.max_batch_tokens = max_batch_tokens or max(self.n_ctx, LOGIT_BUDGET // model.cfg.vocab_size)

    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, bos=bos, allow_special=allow_special)  # normalizes first

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` as ints, refused (self.error) when empty, longer than the context or outside the vocabulary."""
        if len(ids) == 0:
            raise self.error("empty input: give at least one token")
        if len(ids) > self.n_ctx:
            raise self.error(f"input is {len(ids)} tokens, longer than the context ({self.n_ctx})")
        out = [int(i) for i in ids]
        if min(out) < 0 or max(out) >= self.model.cfg.vocab_size:
            raise self.error(f"token ids must be in [0, {self.model.cfg.vocab_size})")
        return out

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """(T, V) fp32 next-token logits for every position, through the full-sequence path."""
        return self.logits_batch([ids])[0]

    @torch.inference_mode()
    def logits_batch(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """(T_i, V) fp32 logits of each sequence, all in one right-padded forward pass."""
        rows = [self.check_ids(s) for s in seqs]
        x = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)  # pad id 0: never attended to
        for b, s in enumerate(rows):
            x[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        out = self.model(x.to(self.device)).float().cpu().numpy()
        return [out[b, : len(s)] for b, s in enumerate(rows)]

    @torch.inference_mode()
    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray:
        """(T, V) like `logits`, through the KV cache: `prefix` tokens in one pass, then one at a time."""
        return torch.cat(feed(transformer_step(self.model), self.check_ids(ids), prefix)).float().cpu().numpy()

    @torch.inference_mode()
    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Argmax continuation of `ids`: stops at an end-of-turn id, max_new_tokens or the context's end."""
        budget = min(max_new_tokens, self.n_ctx - len(ids))
        stop = set(self.eos_ids)
        return list(decode(transformer_step(self.model), self.check_ids(ids), budget, lambda row: int(row.argmax()), stop))

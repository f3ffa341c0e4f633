"""What the metrics score: a `LogProbProvider` (a tokenizer plus per-position log-probabilities),
and `TorchProvider`, a `Transformer` as one. GGUF/ONNX providers live in `export.evaluate`.

The package's leaf: EvalError and the provider protocol, imported by every other module here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from training import chat as chat_template
from training.decode import decode
from training.model import Transformer
from training.tokenizer import Tokenizer

LOGIT_BUDGET = 1 << 26  # fp32 logit elements per forward chunk (256 MiB)


class EvalError(ValueError):
    """Bad evaluation input (a file, a record, an option): one line, shown by the CLI without a traceback."""


@runtime_checkable
class LogProbProvider(Protocol):
    """What the metrics need from a model: its tokenizer and per-position log-probabilities.

    `token_logprobs(ids)` returns a float array of length len(ids) - 1 whose entry i - 1 is
    log p(ids[i] | ids[:i]) for i >= 1; len(ids) <= n_ctx. A provider may also offer
    `token_logprobs_batch(list_of_ids) -> list of arrays` plus `max_batch_tokens` (padded tokens per
    call) to score many sequences per forward pass.
    """

    name: str
    n_ctx: int
    bos_id: int

    def encode(self, text: str) -> list[int]: ...  # normalized text -> ids, without <s>/</s>

    def token_logprobs(self, ids: Sequence[int]) -> np.ndarray: ...


class TorchProvider:
    """A `Transformer` and its tokenizer as a LogProbProvider (batched, right-padded, fp32 log-softmax)
    and as a `generate.Generator` (greedy, through the KV cache)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, name: str = "model",
                 max_batch_tokens: int | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.n_ctx = model.cfg.max_seq_len
        self.bos_id = tokenizer.bos_id
        self.device = next(model.parameters()).device
        self.max_batch_tokens = max_batch_tokens or max(self.n_ctx, LOGIT_BUDGET // model.cfg.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def token_logprobs(self, ids: Sequence[int]) -> np.ndarray:
        return self.token_logprobs_batch([ids])[0]

    @torch.no_grad()
    def token_logprobs_batch(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        lengths = [len(s) for s in seqs]
        if min(lengths) < 1 or max(lengths) > self.n_ctx:
            raise EvalError(f"sequence lengths must be in [1, {self.n_ctx}], got {min(lengths)}..{max(lengths)}")
        x = torch.full((len(seqs), max(lengths)), self.tokenizer.pad_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            x[b, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        x = x.to(self.device)
        # Right padding is invisible to a causal model at the real positions.
        logits = self.model(x)[:, :-1].float()
        lp = F.log_softmax(logits, dim=-1).gather(-1, x[:, 1:, None]).squeeze(-1).double().cpu().numpy()
        return [lp[b, : n - 1] for b, n in enumerate(lengths)]

    def prompt_ids(self, prompt: str, *, chat: bool) -> list[int]:
        """<s> + the chat-templated user turn (a chat model) or the plain text (a base model)."""
        if chat:
            return chat_template.encode(self.tokenizer, [{"role": "user", "content": prompt}]).ids
        return [self.bos_id, *self.tokenizer.encode(prompt)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    @torch.no_grad()
    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Argmax continuation of `ids`: stops at </s> or <|im_end|>, max_new_tokens or the context's end."""
        stop = {self.tokenizer.eos_id, self.tokenizer.im_end_id}
        budget = min(max_new_tokens, self.n_ctx - len(ids))
        return list(decode(self.model, ids, budget, lambda row: int(row.argmax()), stop))

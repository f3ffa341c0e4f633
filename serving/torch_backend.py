"""PyTorch backend: the training model (`training.model.Transformer`) in fp32, as a `Backend`.

The reference runtime. `TorchBackend(path)` serves a checkpoint (a RUN_DIR or one checkpoint folder);
`TorchBackend.from_model(model, tokenizer)` wraps a model already in memory (parity's fp32 reference
and its safetensors reload). KV-cached decoding goes through `forward_with_cache`, sampling through the
shared `serving.backend.sample_next`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from serving.backend import SamplingParams, ServingError, sample_next
from training.checkpoint import TOKENIZER_FILE, CheckpointError, load_model, resolve
from training.decode import decode
from training.model import Transformer
from training.tokenizer import Tokenizer


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ServingError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)  # process-wide, as llama.cpp's n_threads is per model


class TorchBackend:
    name = "torch"

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None, step: int | None = None):
        set_threads(threads)
        # an adapter run (sft.py --lora-rank): its base with the adapter applied
        from training import lora_run

        try:
            if lora_run.is_adapter_run(path):
                model, _ = lora_run.load_adapted(path, step, device=device)
                self.checkpoint, tok = None, Tokenizer.load(resolve(path, step) / TOKENIZER_FILE)
            else:
                model, self.checkpoint = load_model(path, step=step, device=device)
                tok = self.checkpoint.tokenizer
        except CheckpointError as e:
            raise ServingError(str(e)) from None
        self._bind(model, tok, Path(path))

    @classmethod
    def from_model(cls, model: Transformer, tokenizer: Tokenizer, *, name: str = "torch",
                   path: str | Path | None = None, threads: int | None = None) -> TorchBackend:
        """A backend over a model in memory (put in eval mode; its device is kept)."""
        if tokenizer.vocab_size != model.cfg.vocab_size:
            raise ServingError(f"tokenizer has {tokenizer.vocab_size} tokens, the model {model.cfg.vocab_size}")
        set_threads(threads)
        self = cls.__new__(cls)
        self.checkpoint = None
        self._bind(model, tokenizer, Path(path) if path is not None else None)
        self.name = name
        return self

    def _bind(self, model: Transformer, tokenizer: Tokenizer, path: Path | None) -> None:
        self.model = model.eval()
        self.path = path
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.n_ctx = model.cfg.max_seq_len
        self.eos_ids = (tokenizer.eos_id, tokenizer.im_end_id)

    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, bos=bos, allow_special=allow_special)  # normalizes first

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def _check_ids(self, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) == 0:
            raise ServingError("empty input: give at least one token")
        if len(ids) > self.n_ctx:
            raise ServingError(f"input is {len(ids)} tokens, longer than the context ({self.n_ctx})")
        t = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        if int(t.min()) < 0 or int(t.max()) >= self.model.cfg.vocab_size:
            raise ServingError(f"token ids must be in [0, {self.model.cfg.vocab_size})")
        return t

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """(T, V) fp32 next-token logits for every position, through the full-sequence path."""
        return self.model(self._check_ids(ids))[0].float().cpu().numpy()

    @torch.inference_mode()
    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray:
        """(T, V) like `logits`, through the KV cache: `prefix` tokens in one pass, then one at a time."""
        x = self._check_ids(ids)
        first = min(max(prefix, 1), x.shape[1])
        rows, past, start = [], None, 0
        for end in range(first, x.shape[1] + 1):
            pos = torch.arange(start, end, device=self.device)[None]
            out, past = self.model.forward_with_cache(x[:, start:end], pos, past)
            rows.append(out[0])
            start = end
        return torch.cat(rows).float().cpu().numpy()

    @torch.inference_mode()
    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Stream sampled ids; stops at an end-of-turn id, max_new_tokens or the end of the context.

        The end-of-turn id itself is not yielded. Stop strings are text-level and are applied by
        `serving.chat_session.stream_text`, which sees the decoded text.
        """
        params.validate()
        self._check_ids(ids)
        history = list(ids)
        rng = np.random.default_rng(params.seed)
        budget = min(params.max_new_tokens, self.n_ctx - len(history))

        def pick(row: torch.Tensor) -> int:
            return sample_next(row.float().cpu().numpy(), params, history, rng)

        for nxt in decode(self.model, history, budget, pick, self.eos_ids):  # training's one decode loop
            history.append(nxt)
            yield nxt

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]

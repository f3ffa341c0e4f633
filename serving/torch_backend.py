"""PyTorch backend: serves a training checkpoint (a RUN_DIR or one checkpoint folder) directly.

The reference runtime: fp32, the one model definition (`training.model.Transformer`), KV-cached
decoding through `forward_with_cache`, sampling through the shared `serving.backend.sample_next`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from serving.backend import SamplingParams, ServingError, sample_next
from training.checkpoint import CheckpointError, load_model


class TorchBackend:
    name = "torch"

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None, step: int | None = None):
        if threads is not None:
            if threads < 1:
                raise ServingError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)  # process-wide, as llama.cpp's n_threads is per model
        try:
            self.model, self.checkpoint = load_model(path, step=step, device=device)
        except CheckpointError as e:
            raise ServingError(str(e)) from None
        self.path = Path(path)
        self.device = torch.device(device)
        self.tokenizer = self.checkpoint.tokenizer
        self.n_ctx = self.model.cfg.max_seq_len
        self.eos_ids = (self.tokenizer.eos_id, self.tokenizer.im_end_id)

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
    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Stream sampled ids; stops at an end-of-turn id, max_new_tokens or the end of the context.

        The end-of-turn id itself is not yielded. Stop strings are text-level and are applied by
        `serving.chat_session.stream_text`, which sees the decoded text.
        """
        params.validate()
        x = self._check_ids(ids)
        history = list(ids)
        rng = np.random.default_rng(params.seed)
        budget = min(params.max_new_tokens, self.n_ctx - len(history))
        past = None
        pos = torch.arange(len(history), device=self.device)[None]
        for _ in range(budget):
            logits, past = self.model.forward_with_cache(x, pos, past)
            nxt = sample_next(logits[0, -1].float().cpu().numpy(), params, history, rng)
            if nxt in self.eos_ids:
                return
            history.append(nxt)
            yield nxt
            x = torch.tensor([[nxt]], dtype=torch.long, device=self.device)
            pos = torch.tensor([[len(history) - 1]], device=self.device)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
